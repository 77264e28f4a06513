from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tandem.params import SamplingParams
from tandem.sampling.bitmask import bitmask_words
from tandem.sampling.sampler import (
    RowLogprobs,
    Sampler,
    SamplingRow,
    prompt_logprobs,
    tied_ids,
    top_candidates,
)

EOS = 9


def _row(prompt: Sequence[int] = (), output: Sequence[int] = (), **params: object) -> SamplingRow:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return SamplingRow(params=p, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=gen)


def _survivors(probs: torch.Tensor) -> list[int]:
    return (probs > 0).nonzero().flatten().tolist()


def _chi2_threshold(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at ~1e-6 (z = 4.75): a fixed false-alarm rate, so the
    accepted deviation of the frequencies shrinks like 1 / sqrt(n)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    expected = expected_probs * n
    support = expected_probs > 0
    assert (counts[~support] == 0).all(), "drew a token outside the support"
    assert (expected[support] >= 5).all(), "test design: too few samples per cell for chi-square"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return stat, int(support.sum().item()) - 1


# ------------------------------------------------------------------------------------------- masks, greedy ---


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    out = Sampler(20, [EOS]).sample(logits, [_row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_all_greedy_batch_leaves_the_global_rng_alone() -> None:
    logits = torch.randn(3, 20)
    state = torch.get_rng_state()
    Sampler(20, [EOS]).sample(logits, [_row(temperature=0.0) for _ in range(3)])
    assert torch.equal(state, torch.get_rng_state())


def test_greedy_probs_are_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    probs = Sampler(4, [EOS]).probs(logits, [_row(temperature=0.0)])
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    for t in (0.5, 1.0, 2.0):
        probs = Sampler(4, [EOS]).probs(logits, [_row(temperature=t)])
        torch.testing.assert_close(probs[0], torch.softmax(logits[0] / t, -1))


# probs 0.5, 0.3, 0.15, 0.05 (token order shuffled so the masks are not just prefixes)
_P = torch.tensor([0.15, 0.5, 0.05, 0.3])
_LOGITS = _P.log().unsqueeze(0)


@pytest.mark.parametrize(
    "params, kept",
    [
        ({"top_k": 1}, [1]),
        ({"top_k": 2}, [1, 3]),
        ({"top_k": 3}, [0, 1, 3]),
        ({"top_k": 4}, [0, 1, 2, 3]),
        ({"top_k": 50}, [0, 1, 2, 3]),
        ({"top_p": 0.4}, [1]),  # the argmax alone already has 0.5 >= 0.4
        ({"top_p": 0.75}, [1, 3]),  # 0.5 < 0.75, 0.8 >= 0.75
        ({"top_p": 0.85}, [0, 1, 3]),
        ({"top_p": 0.99}, [0, 1, 2, 3]),
        ({"min_p": 0.35}, [1, 3]),  # threshold 0.175
        ({"min_p": 0.2}, [0, 1, 3]),  # threshold 0.1
        ({"min_p": 1.0}, [1]),
        ({"top_k": 3, "top_p": 0.7}, [1, 3]),  # top-3 renormalised: 0.526, 0.316 -> 0.842 >= 0.7
        ({"top_k": 2, "min_p": 0.7}, [1]),
    ],
)
def test_top_k_top_p_min_p_keep_exactly(params: dict[str, Any], kept: list[int]) -> None:
    probs = Sampler(4, [EOS]).probs(_LOGITS, [_row(**params)])[0]
    assert _survivors(probs) == kept
    torch.testing.assert_close(probs[kept], _P[kept] / _P[kept].sum())


def test_top_k_keeps_ties_with_the_kth() -> None:
    probs = Sampler(4, [EOS]).probs(torch.tensor([[3.0, 1.0, 3.0, 2.0]]), [_row(top_k=1)])[0]
    assert _survivors(probs) == [0, 2]


def test_min_p_applies_before_top_p_as_in_vllm_v1() -> None:
    # p = 0.5, 0.3, 0.2. min-p 0.5 keeps {0, 1} (renormalised 0.625, 0.375), then top-p 0.6 keeps {0}.
    # (top-p first would keep {0, 1} and min-p would keep both.)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    probs = Sampler(3, [EOS]).probs(logits, [_row(min_p=0.5, top_p=0.6)])[0]
    assert _survivors(probs) == [0]


def test_mixed_batch_rows_equal_rows_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=gen) * 2
    rows = [
        _row(temperature=0.0),
        _row(top_k=5),
        _row(top_p=0.6, temperature=0.7),
        _row(min_p=0.1, top_k=10, top_p=0.9),
        _row(prompt=[1, 2], output=[2, 2, 5], repetition_penalty=1.5, frequency_penalty=0.5),
        _row(temperature=1.3, logit_bias={4: 3.0}),
    ]
    sampler = Sampler(30, [EOS])
    batch = sampler.probs(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(batch[i], sampler.probs(logits[i : i + 1], [r])[0])


def test_padded_vocab_columns_are_never_chosen() -> None:
    logits = torch.zeros(2, 40)
    logits[:, 35] = 100.0  # a padded lm_head column beyond the real vocabulary
    out = Sampler(32, [EOS]).sample(logits, [_row(temperature=0.0), _row()])
    assert all(t < 32 for t in out.token_ids)


# ------------------------------------------------------------------------------------------ logits processors ---


def _reference_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_match_reference_formula() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(5)) * 3
    cases = [
        ([1, 2, 3], [3, 3, 4], 1.7, 0.0, 0.0),
        ([1, 2, 3], [3, 3, 4, 4, 4, 7], 1.0, 0.6, 0.0),
        ([0, 5], [5, 6, 6], 1.0, 0.0, -0.8),
        ([0, 1, 11], [11, 2, 2, 2, 9], 0.7, 1.2, 0.4),
    ]
    rows = [
        _row(prompt=p, output=o, repetition_penalty=r, frequency_penalty=f, presence_penalty=pr)
        for p, o, r, f, pr in cases
    ]
    got = Sampler(12, [EOS]).processed_logits(logits, rows)
    for i, (p, o, r, f, pr) in enumerate(cases):
        torch.testing.assert_close(got[i], _reference_penalties(logits[i], p, o, r, f, pr))


def test_rows_without_penalties_are_unchanged() -> None:
    logits = torch.randn(2, 12)
    rows = [_row(prompt=[1, 2], output=[2, 3]), _row(prompt=[1], output=[1], repetition_penalty=2.0)]
    got = Sampler(12, [EOS]).processed_logits(logits, rows)
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])


def test_logit_bias_is_added() -> None:
    logits = torch.zeros(2, 6)
    got = Sampler(6, [EOS]).processed_logits(logits, [_row(logit_bias={1: 2.5, 4: -100.0}), _row()])
    assert got[0].tolist() == [0.0, 2.5, 0.0, 0.0, -100.0, 0.0]
    assert got[1].tolist() == [0.0] * 6


def test_allowed_token_ids_disallow_all_others() -> None:
    logits = torch.randn(3, 10)
    rows = [_row(allowed_token_ids=[2, 7]), _row(), _row(allowed_token_ids=[0])]
    got = Sampler(10, [EOS]).processed_logits(logits, rows)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [2, 7]
    assert torch.equal(got[0, [2, 7]], logits[0, [2, 7]])
    assert torch.equal(got[1], logits[1])
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [0]
    out = Sampler(10, [EOS]).sample(logits, rows)
    assert out.token_ids[0] in (2, 7) and out.token_ids[2] == 0


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 12)
    rows = [
        _row(output=[1, 2], min_tokens=3, stop_token_ids=[4, 5]),  # 2 < 3: blocked
        _row(output=[1, 2, 3], min_tokens=3, stop_token_ids=[4, 5]),  # reached: free
        _row(output=[], min_tokens=1, ignore_eos=True),
    ]
    got = Sampler(12, [EOS, 11]).processed_logits(logits, rows)
    assert torch.isneginf(got[0]).nonzero().flatten().tolist() == [4, 5, 9, 11]
    assert torch.isfinite(got[1]).all()
    assert torch.isneginf(got[2]).nonzero().flatten().tolist() == [9, 11]
    logits[:, EOS] = 50.0
    assert Sampler(12, [EOS]).sample(logits[:1], [_row(min_tokens=2, temperature=0.0)]).token_ids[0] != EOS


def test_bitmask_disallows_before_everything_else() -> None:
    vocab = 40
    logits = torch.arange(vocab, dtype=torch.float32).repeat(2, 1)  # argmax would be 39
    bitmask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 17)  # row 0: tokens 3, 17
    bitmask[1] = -1  # row 1: everything
    rows = [_row(temperature=0.0, logit_bias={3: 30.0}), _row(temperature=0.0)]
    out = Sampler(vocab, [EOS]).sample(logits, rows, bitmask=bitmask)
    assert out.token_ids == [3, 39]  # 3 + 30 > 17 among the allowed
    probs = Sampler(vocab, [EOS]).probs(logits, [_row(), _row()], bitmask=bitmask)
    assert _survivors(probs[0]) == [3, 17]


# ------------------------------------------------------------------------------------------------ sampling ---


def _seeded_tokens(batch_size: int, position: int, seed: int, steps: int, logits_row: torch.Tensor) -> list[int]:
    """The seeded row's tokens over `steps` steps, sitting at `position` among other kinds of rows."""
    sampler = Sampler(logits_row.shape[0], [EOS])
    others = [_row(), _row(temperature=0.0), _row(seed=seed + 1, top_k=5), _row(top_p=0.5)]
    mine = _row(seed=seed, temperature=0.9, top_p=0.95)  # fresh generator seeded with `seed`
    rows = [others[i % len(others)] for i in range(batch_size - 1)]
    rows.insert(position, mine)
    logits = torch.randn(batch_size, logits_row.shape[0]) * 2
    logits[position] = logits_row
    tokens = []
    for _ in range(steps):
        tokens.append(sampler.sample(logits, rows).token_ids[position])
    return tokens


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    logits_row = torch.randn(50, generator=torch.Generator().manual_seed(11)) * 0.5
    alone = _seeded_tokens(1, 0, seed=1234, steps=6, logits_row=logits_row)
    assert len(set(alone)) > 1  # really random, not a constant
    for batch_size, position in [(2, 1), (5, 3), (8, 0), (8, 7)]:
        assert _seeded_tokens(batch_size, position, 1234, 6, logits_row) == alone
    assert _seeded_tokens(1, 0, seed=99, steps=6, logits_row=logits_row) != alone


@pytest.mark.parametrize("params", [{"temperature": 0.8, "top_p": 0.8}, {"temperature": 1.5, "top_k": 5, "min_p": 0.05}])
def test_sampling_frequencies_match_the_distribution(params: dict[str, Any]) -> None:
    torch.manual_seed(0)
    logits_row = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.0, 1.6])
    sampler = Sampler(8, [EOS])
    expected = sampler.probs(logits_row.unsqueeze(0), [_row(**params)])[0]
    # Independent reference for the top-p case: softmax(l / T), keep the smallest top set with mass >= top_p.
    if "top_p" in params:
        base = torch.softmax(logits_row / params["temperature"], -1)
        order = base.argsort(descending=True)
        mass_before = base[order].cumsum(0) - base[order]
        keep = order[mass_before < params["top_p"]]
        ref = torch.zeros(8)
        ref[keep] = base[keep] / base[keep].sum()
        torch.testing.assert_close(expected, ref)
    n = 40_000
    rows = [_row(**params)] * n
    tokens = torch.tensor(sampler.sample(logits_row.expand(n, 8), rows).token_ids)
    counts = torch.bincount(tokens, minlength=8).float()
    stat, df = _chi2(counts, expected)
    assert stat < _chi2_threshold(df), (stat, df, counts / n, expected)


def test_chi2_check_detects_a_wrong_temperature() -> None:
    torch.manual_seed(1)
    logits_row = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.0, 1.6])
    sampler = Sampler(8, [EOS])
    n = 40_000
    tokens = torch.tensor(sampler.sample(logits_row.expand(n, 8), [_row(temperature=1.2)] * n).token_ids)
    stat, df = _chi2(torch.bincount(tokens, minlength=8).float(), torch.softmax(logits_row, -1))
    assert stat > _chi2_threshold(df)


# ------------------------------------------------------------------------------------------------ logprobs ---


def _check_logprobs(lp: RowLogprobs, raw: torch.Tensor, token: int, n: int) -> None:
    ref = torch.log_softmax(raw.float(), -1)
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-5)
    assert lp.rank == 1 + int((ref > ref[token]).sum())
    assert len(lp.top_ids) == len(lp.top_logprobs) == n
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert lp.top_ids == ref.argsort(descending=True)[:n].tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), ref[lp.top_ids])


def test_logprobs_are_of_the_raw_logits() -> None:
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)) * 2
    low = int(logits[0].argmin())
    rows = [
        _row(temperature=0.0, logprobs=3, logit_bias={low: 100.0}),  # processing picks the worst raw token
        _row(logprobs=0, repetition_penalty=2.0, prompt=[1, 2, 3]),
        _row(),
        _row(temperature=0.0, logprobs=5),
    ]
    out = Sampler(16, [EOS]).sample(logits.to(torch.bfloat16).float(), rows)
    assert out.token_ids[0] == low
    raw = logits.to(torch.bfloat16).float()
    _check_logprobs(out.logprobs[0], raw[0], low, 3)  # type: ignore[arg-type]
    assert out.logprobs[0].rank == 16  # type: ignore[union-attr]
    _check_logprobs(out.logprobs[1], raw[1], out.token_ids[1], 0)  # type: ignore[arg-type]
    assert out.logprobs[2] is None
    _check_logprobs(out.logprobs[3], raw[3], out.token_ids[3], 5)  # type: ignore[arg-type]
    assert out.logprobs[3].rank == 1  # type: ignore[union-attr]


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, 10)
    tokens = [4, 0, 9, 9, 1]
    got = prompt_logprobs(logits, tokens, top_n=2, chunk_rows=2)
    assert len(got) == 5
    for i, tok in enumerate(tokens):
        _check_logprobs(got[i], logits[i], tok, 2)


def test_top_candidates_and_tied_ids_on_bf16() -> None:
    """The candidate walk of unmasked greedy rows: the k largest logits in the logits' dtype, and every token tied at
    a value (ascending), None past the limit."""
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    logits[0, [2, 5, 7]] = 3.0
    logits[0, 4] = 5.0
    logits[1, 1] = 1.5
    (values, ids), = top_candidates(logits, [0], 2)
    assert values[0] == 5.0 and ids[0] == 4 and values[1] == 3.0 and ids[1] in (2, 5, 7)
    assert tied_ids(logits, [0, 1], [3.0, 1.5], limit=8) == [[2, 5, 7], [1]]
    assert tied_ids(logits, [0], [0.0], limit=3) == [None]  # six tokens tie at 0
