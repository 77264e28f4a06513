from __future__ import annotations

import math

import pytest
import torch

import tandem.sampling.rejection as rejection
from tandem.params import SamplingParams
from tandem.sampling.rejection import DraftRows, rejection_sample, residual_probs
from tandem.sampling.sampler import Sampler, SamplingRow

V = 6
EOS = 5


def _chi2_threshold(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at ~1e-6: a fixed false-alarm rate, so the accepted
    deviation of the empirical frequencies shrinks like 1 / sqrt(n)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square of `counts` against `expected_probs` (any shape); cells expecting fewer than 5 draws
    are pooled into one cell. Returns (statistic, degrees of freedom)."""
    counts, expected_probs = counts.flatten().double(), expected_probs.flatten().double()
    n = counts.sum().item()
    support = expected_probs > 0
    assert (counts[~support] == 0).all(), "emitted a token the target gives probability 0"
    expected, observed = expected_probs[support] * n, counts[support]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
        observed = torch.cat([observed[~small], observed[small].sum().unsqueeze(0)])
    assert expected.min() >= 5, "test design: too few samples"
    return ((observed - expected) ** 2 / expected).sum().item(), expected.numel() - 1


class _Target:
    """A tiny 'target model' over V tokens: logits at the context, after token a, and after tokens (a, b)."""

    def __init__(self, seed: int, params: SamplingParams) -> None:
        g = torch.Generator().manual_seed(seed)
        self.first = torch.randn(V, generator=g) * 1.5  # [V]
        self.second = torch.randn(V, V, generator=g) * 1.5  # [a, V]
        self.third = torch.randn(V, V, V, generator=g) * 1.5  # [a, b, V]
        self.params = params
        self.sampler = Sampler(V, [EOS])
        self._rows: dict[tuple[int, ...], SamplingRow] = {}

    def row(self, output: list[int]) -> SamplingRow:
        """The (shared, read-only) row whose outputs so far are `output`."""
        key = tuple(output)
        if key not in self._rows:
            self._rows[key] = SamplingRow(self.params, prompt_token_ids=[0], output_token_ids=key)
        return self._rows[key]

    def p_first(self) -> torch.Tensor:  # [V] the sampler's own final distribution
        return self.sampler.probs(self.first.unsqueeze(0), [self.row([])])[0]

    def p_pair(self) -> torch.Tensor:  # [V, V] p(a) * p(b | a)
        second = self.sampler.probs(self.second, [self.row([a]) for a in range(V)])  # [a, V]
        return self.p_first().unsqueeze(1) * second


def _first_two_tokens(target: _Target, n: int, q1: torch.Tensor | None, q2: torch.Tensor | None, seed: int) -> torch.Tensor:
    """[n, 2] the first two tokens emitted by n independent requests speculating 2 drafts.

    q1 [V], q2 [a, V]: the proposer's distributions (None: a deterministic proposer, d1 = 2, d2 = (d1 + 1) % V).
    A request that emits only one token this step takes its second from the next step (no drafts).
    """
    torch.manual_seed(seed)
    if q1 is None or q2 is None:
        d1 = torch.full((n,), 2, dtype=torch.long)
        d2 = (d1 + 1) % V
    else:
        d1 = torch.multinomial(q1, n, replacement=True)  # [n]
        d2 = torch.multinomial(q2[d1], 1).squeeze(1)  # [n]
    logits = torch.stack([target.first.expand(n, V), target.second[d1], target.third[d1, d2]], dim=1)  # [n, 3, V]
    q_after = [None if q1 is None or q2 is None else torch.stack([q1, q2[a]]) for a in range(V)]  # [2, V] per d1
    rows: list[SamplingRow] = []
    drafts: list[DraftRows] = []
    for a, b in zip(d1.tolist(), d2.tolist(), strict=True):
        rows += [target.row([]), target.row([a]), target.row([a, b])]
        drafts.append(DraftRows([a, b], q_after[a]))
    emitted = [v.tokens for v in rejection_sample(target.sampler, logits.reshape(3 * n, V), rows, drafts)]
    assert all(1 <= len(e) <= 3 for e in emitted)
    short = [i for i, e in enumerate(emitted) if len(e) == 1]
    if short:  # next step without drafts: one token from p(. | x1)
        firsts = [emitted[i][0] for i in short]
        nxt = rejection_sample(
            target.sampler, target.second[firsts], [target.row([a]) for a in firsts], [DraftRows([], None)] * len(short)
        )
        for i, v in zip(short, nxt, strict=True):
            assert len(v.tokens) == 1 and not v.dead
            emitted[i].append(v.tokens[0])
    return torch.tensor([e[:2] for e in emitted])


def _lossless_stats(target: _Target, n: int, deterministic: bool, seed: int) -> tuple[float, int, float, int]:
    g = torch.Generator().manual_seed(seed + 100)
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    pairs = _first_two_tokens(target, n, None if deterministic else q1, None if deterministic else q2, seed)
    first_counts = torch.bincount(pairs[:, 0], minlength=V)
    pair_counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    s1, df1 = _chi2(first_counts, target.p_first())
    s2, df2 = _chi2(pair_counts, target.p_pair())
    return s1, df1, s2, df2


TARGETS = [
    pytest.param(SamplingParams(), id="T=1"),
    pytest.param(SamplingParams(temperature=0.8, top_k=4), id="T=0.8,top_k=4"),
]


@pytest.mark.parametrize("params", TARGETS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["q-probs", "q-one-hot"])
def test_emitted_tokens_follow_the_target(params: SamplingParams, deterministic: bool) -> None:
    target = _Target(seed=7, params=params)
    s1, df1, s2, df2 = _lossless_stats(target, n=5_000, deterministic=deterministic, seed=1)
    assert s1 < _chi2_threshold(df1), (s1, df1)
    assert s2 < _chi2_threshold(df2), (s2, df2)


def test_check_detects_resampling_from_p_instead_of_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model's q: after a rejection the token must come from the residual."""
    monkeypatch.setattr(rejection, "residual_probs", lambda target, draft: target)
    target = _Target(seed=7, params=SamplingParams())
    s1, df1, s2, df2 = _lossless_stats(target, n=5_000, deterministic=False, seed=1)
    assert s1 > _chi2_threshold(df1)
    assert s2 > _chi2_threshold(df2)


def test_check_detects_one_hot_drafts_judged_by_a_shared_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-hot drafts: each row must draw its own sample; one noise vector shared by all the rows is caught."""
    def shared(p: torch.Tensor, rows: object, index: list[int]) -> torch.Tensor:
        q = torch.empty(p.shape[-1]).exponential_()  # [V], the same for every row
        return (p[torch.tensor(index)] / q).argmax(dim=-1)

    monkeypatch.setattr(rejection, "_row_samples", shared)
    target = _Target(seed=7, params=SamplingParams())
    s1, df1, s2, df2 = _lossless_stats(target, n=5_000, deterministic=True, seed=1)
    assert s1 > _chi2_threshold(df1) or s2 > _chi2_threshold(df2)


def test_residual_is_positive_part_of_p_minus_q() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([[0.4, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(residual_probs(p, p), p)  # no residual mass: fall back to p


# ---------------------------------------------------------------------------------------------------- greedy ---


def _greedy_target(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_greedy_accepts_the_matching_prefix_then_the_argmax() -> None:
    sampler = Sampler(V, [EOS])
    row = SamplingRow(SamplingParams(temperature=0.0))
    argmaxes = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [0], [3, 3]]
    drafts = [
        DraftRows([1, 2, 3]),  # all match: drafts + bonus argmax
        DraftRows([1, 4, 3]),  # second mismatches: [1, argmax 2]
        DraftRows([5, 2, 3], torch.full((3, V), 1.0 / V)),  # first mismatches; q is ignored for greedy
        DraftRows([]),  # no drafts: plain greedy
        DraftRows([3]),
    ]
    logits = torch.cat([_greedy_target(a) for a in argmaxes])
    rows = [row] * logits.shape[0]
    assert [v.tokens for v in rejection_sample(sampler, logits, rows, drafts)] == [[1, 2, 3, 4], [1, 2], [1], [0], [3, 3]]
    # Exactly what non-speculative greedy emits at those positions.
    assert sampler.sample(logits, rows).token_ids[:4] == [1, 2, 3, 4]


def test_greedy_respects_penalties_and_bitmask_per_row() -> None:
    sampler = Sampler(V, [EOS])
    logits = torch.zeros(3, V)
    logits[:, 1] = 5.0
    logits[:, 2] = 4.0
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    # Row j sees drafts[:j] as outputs: after draft 1 the penalty makes token 2 the argmax.
    rows = [SamplingRow(params, [0], []), SamplingRow(params, [0], [1]), SamplingRow(params, [0], [1, 2])]
    assert rejection_sample(sampler, logits, rows, [DraftRows([1, 2])]) == [([1, 2, 1], False)]
    bitmask = torch.full((3, 1), -1, dtype=torch.int32)
    bitmask[2, 0] = 1 << 4  # last row: only token 4
    assert rejection_sample(sampler, logits, rows, [DraftRows([1, 2])], bitmask=bitmask) == [([1, 2, 4], False)]


# --------------------------------------------------------------------------------------------------- seeding ---


def _seeded_run(seed: int, position: int, batch: int) -> list[list[int]]:
    sampler = Sampler(V, [EOS])
    g = torch.Generator().manual_seed(123)
    mine_logits = torch.randn(3, V, generator=g) * 0.3  # flat: frequent rejections and varied tokens
    mine_q = torch.softmax(torch.randn(2, V, generator=g), -1)
    logits: list[torch.Tensor] = []
    rows: list[SamplingRow] = []
    drafts: list[DraftRows] = []
    for i in range(batch):
        if i == position:
            params = SamplingParams(seed=seed)
            gen = torch.Generator().manual_seed(seed)
            logits.append(mine_logits)
            rows += [SamplingRow(params, [0], [], gen)] * 3
            drafts.append(DraftRows([1, 4], mine_q))
        else:
            k = i % 3
            other = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=3)
            logits.append(torch.randn(k + 1, V))
            rows += [SamplingRow(other)] * (k + 1)
            drafts.append(DraftRows(list(range(k))))
    target = torch.cat(logits)
    return [rejection_sample(sampler, target, rows, drafts)[position].tokens for _ in range(6)]


def test_seeded_requests_reproduce_whatever_the_batch() -> None:
    alone = _seeded_run(seed=5, position=0, batch=1)
    assert len({tuple(x) for x in alone}) > 1  # really random across steps
    assert _seeded_run(seed=5, position=2, batch=4) == alone
    assert _seeded_run(seed=5, position=5, batch=6) == alone


def test_narrower_draft_vocabulary_is_padded_with_zero_mass() -> None:
    sampler = Sampler(V, [EOS])
    logits = torch.zeros(2, V)
    logits[0, 0] = -float("inf")  # the target never emits token 0
    q = torch.zeros(1, V - 2)
    q[0, 0] = 1.0  # the draft model (vocabulary V - 2) always proposes token 0
    rows = [SamplingRow(SamplingParams())] * 2
    for _ in range(20):
        [(emitted, dead)] = rejection_sample(sampler, logits, rows, [DraftRows([0], q)])
        assert len(emitted) == 1 and emitted[0] != 0 and not dead


def test_row_count_mismatch_raises() -> None:
    sampler = Sampler(V, [EOS])
    with pytest.raises(ValueError):
        rejection_sample(sampler, torch.zeros(2, V), [SamplingRow(SamplingParams())] * 2, [DraftRows([1, 2])])


# --------------------------------------------------------------------------------- rows where nothing is allowed ---
def _only(*allowed: int) -> int:
    """A bitmask word allowing just `allowed` (V <= 32)."""
    return sum(1 << t for t in allowed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dead_row_reached_by_the_walk_keeps_the_drafts_accepted_before_it(temperature: float) -> None:
    """Drafts [1, 2]: rows 0 and 1 allow (only) them, row 2 allows nothing. Both drafts are accepted, the bonus row
    is dead: the request gets [1, 2] and `dead`, never a token drawn from the dead row."""
    sampler = Sampler(V, [EOS])
    rows = [SamplingRow(SamplingParams(temperature=temperature, seed=1), generator=torch.Generator().manual_seed(1))] * 3
    bitmask = torch.tensor([[_only(1)], [_only(2)], [0]], dtype=torch.int32)
    assert rejection_sample(sampler, torch.zeros(3, V), rows, [DraftRows([1, 2])], bitmask=bitmask) == [([1, 2], True)]
    # a dead first row: nothing at all
    bitmask = torch.tensor([[0], [_only(2)], [_only(3)]], dtype=torch.int32)
    assert rejection_sample(sampler, torch.zeros(3, V), rows, [DraftRows([1, 2])], bitmask=bitmask) == [([], True)]


def test_dead_row_past_a_rejection_does_not_matter() -> None:
    """Draft 1 is rejected at row 0 (the target wants 3): rows 1 and 2 are never reached, so the dead row 2 must
    not end the request; it emits the target's token 3. A neighbour with all rows alive is unaffected."""
    sampler = Sampler(V, [EOS])
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    logits = torch.zeros(5, V)
    logits[0, 3] = 5.0  # row 0: argmax 3, so draft 1 is rejected
    logits[3:, 4] = 5.0
    bitmask = torch.tensor([[-1], [-1], [0], [-1], [-1]], dtype=torch.int32)
    out = rejection_sample(sampler, logits, [greedy] * 5, [DraftRows([1, 2]), DraftRows([4])], bitmask=bitmask)
    assert out == [([3], False), ([4, 4], False)]


def test_sampler_reports_dead_rows_and_draws_nothing_from_them() -> None:
    """min_tokens bans EOS where a grammar allows only EOS: that row is dead; the others sample normally."""
    sampler = Sampler(V, [EOS])
    logits = torch.zeros(3, V)
    rows = [SamplingRow(SamplingParams(min_tokens=2), [0], [5]), SamplingRow(SamplingParams(min_tokens=2), [0], [5, 6]),
            SamplingRow(SamplingParams(temperature=0.0))]
    bitmask = torch.tensor([[_only(EOS)], [_only(EOS)], [_only(3, EOS)]], dtype=torch.int32)
    out = sampler.sample(logits, rows, bitmask)
    assert out.dead_rows == [0]  # row 1 has 2 outputs already: EOS is allowed again
    assert out.token_ids[1:] == [EOS, 3]
    assert sampler.probs(logits, rows, bitmask)[0].sum() == 0
