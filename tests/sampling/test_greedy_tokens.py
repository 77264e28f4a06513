"""`torch.ops.tandem.greedy_tokens` (the fused greedy sampler under a grammar bitmask) against the torch path it
replaces: `Sampler.processed_logits` (float32 copy, padded columns and disallowed tokens at -inf) then argmax and the
all-(-inf) dead-row check. Same token for every row (ties to the lowest id), same dead rows, for float32, bfloat16
and float16 logits, sparse, dense, empty and short masks, a padded vocabulary, and -inf logits among the allowed."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.kernels import load_cpu_kernels
from tandem.params import SamplingParams
from tandem.sampling.bitmask import bitmask_words
from tandem.sampling.sampler import Sampler, SamplingRow, only_greedy

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="tandem CPU kernels could not be built here")


def _reference(logits: torch.Tensor, mask: torch.Tensor | None, vocab: int) -> tuple[list[int], list[int]]:
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(logits.shape[0])]
    x = Sampler(vocab, [0]).processed_logits(logits, rows, mask)
    dead = torch.isneginf(x).all(dim=-1)
    return x.argmax(dim=-1).masked_fill(dead, 0).tolist(), dead.nonzero().flatten().tolist()


def _masks(rows: int, words: int, g: torch.Generator) -> torch.Tensor:
    """Rows of every kind a grammar produces: random bits, all allowed, nothing, one token, a few sparse words."""
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    m[1::5] = -1  # everything allowed
    m[2::5] = 0  # nothing allowed: a dead row
    m[3::5] = 0
    m[3::5, words // 2] = 1 << 7  # one token
    sparse = torch.zeros(words, dtype=torch.int32)
    sparse[torch.randint(0, words, (6,), generator=g)] = torch.randint(1, 2**31 - 1, (6,), dtype=torch.int32, generator=g)
    m[4::5] = sparse
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("vocab", "columns"), [(1000, 1000), (49152, 49152), (50257, 50304), (37, 64)])
def test_greedy_tokens_matches_the_torch_sampler(dtype: torch.dtype, vocab: int, columns: int) -> None:
    g = torch.Generator().manual_seed(vocab + columns)
    logits = (torch.randn(23, columns, generator=g) * 4).to(dtype)
    logits[5, :] = 1.0  # ties everywhere: the lowest allowed id wins
    logits[6, : columns // 2] = float("-inf")  # -inf logits among the allowed tokens
    logits[7, :] = float("-inf")  # every logit -inf: dead whatever the mask
    mask = _masks(23, bitmask_words(columns), g)
    for m in (mask, None, mask[:, : max(1, mask.shape[1] // 3)].contiguous()):  # also a mask shorter than the vocab
        got = torch.ops.tandem.greedy_tokens(logits, m, vocab)
        want_tokens, want_dead = _reference(logits, m, vocab)
        assert got.clamp_min(0).tolist() == want_tokens
        assert (got < 0).nonzero().flatten().tolist() == want_dead


def test_sampler_takes_the_fused_path_for_greedy_rows_and_not_for_others() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 4096, generator=g) * 3).to(torch.bfloat16)
    mask = _masks(8, bitmask_words(4096), g)
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(8)]
    s = Sampler(4000, [0])
    assert only_greedy(greedy) and s._fused_greedy_applies(logits, mask, 8)
    out = s.sample(logits, greedy, mask)
    want_tokens, want_dead = _reference(logits, mask, 4000)
    assert out.token_ids == want_tokens and out.dead_rows == want_dead
    ahead = s.sample(logits, greedy, mask, all_greedy=True)  # the rows' greediness told, as StepSampler.prepare does
    assert ahead.token_ids == want_tokens and ahead.dead_rows == want_dead
    biased = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: 5.0}), [1], [], None)] + greedy[1:]
    assert not only_greedy(biased)  # logit bias changes the logits: the torch path
    assert s.greedy_tokens(logits, biased, mask) is None and s.greedy_tokens(logits, greedy, mask, all_greedy=False) is None
    sampled = [SamplingRow(SamplingParams(temperature=0.7), [1], [], None)] + greedy[1:]
    assert not only_greedy(sampled)
    assert not s._fused_greedy_applies(logits[:, ::2], mask, 8)  # strided columns: the torch path
    assert not s._fused_greedy_applies(logits, mask, 5)  # a mask row for each row read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_in_place_are_the_rows_copied_out(dtype: torch.dtype) -> None:
    """`rows` (the op) and `index` (the sampler): rows picked from the logits, repeated and out of order, read where
    they are, give the tokens of those rows copied out; a row outside the logits is refused."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(12, 3008, generator=g) * 3).to(dtype)
    picked = torch.tensor([7, 0, 11, 3, 3, 9, 2], dtype=torch.long)
    mask = _masks(len(picked), bitmask_words(3008), g)
    copied = logits.index_select(0, picked)
    for m in (mask, None):
        assert torch.equal(torch.ops.tandem.greedy_tokens(logits, m, 3000, picked),
                           torch.ops.tandem.greedy_tokens(copied, m, 3000))
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.tandem.greedy_tokens(logits, None, 3000, torch.tensor([0, 12]))
    s = Sampler(3000, [0])
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(len(picked))]
    want = s.sample(copied, greedy, mask)
    got = s.sample(logits, greedy, mask, index=picked)
    assert (got.token_ids, got.dead_rows) == (want.token_ids, want.dead_rows)
    # rows that want logprobs, or sample at a temperature, take the copy: the same output as the copied rows'
    lp = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], [], None)] + greedy[1:]
    got, want = s.sample(logits, lp, mask, index=picked), s.sample(copied, lp, mask)
    assert (got.token_ids, got.dead_rows, got.logprobs) == (want.token_ids, want.dead_rows, want.logprobs)
    seeded = [SamplingRow(SamplingParams(temperature=0.8, seed=1), [1], [], torch.Generator().manual_seed(5))
              for _ in range(len(picked))]
    got = s.sample(logits, seeded, None, index=picked)
    for r in seeded:
        r.generator.manual_seed(5)
    assert got.token_ids == s.sample(copied, seeded, None).token_ids


def test_greedy_verification_matches_the_general_rejection_sampler() -> None:
    """Drafts that match their rows' greedy tokens for a while, then not; all accepted; a dead row in the middle of
    a walk and one past a rejection (which must not matter)."""
    from tandem.sampling.rejection import DraftRows, greedy_verify, rejection_sample

    g = torch.Generator().manual_seed(3)
    vocab, sizes = 3000, [4, 1, 3, 5, 2]
    n = sum(sizes)
    logits = (torch.randn(n, 3008, generator=g) * 3).to(torch.bfloat16)
    mask = _masks(n, bitmask_words(3008), g)
    mask[2::5] = -1  # no dead rows from the generic pattern ...
    mask[7] = 0  # ... but one on request 2's third row
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(n)]
    s = Sampler(vocab, [0])
    targets = s.greedy_tokens(logits, rows, mask)
    assert targets is not None
    drafts, start = [], 0
    for i, k in enumerate(sizes):
        want = [max(t, 0) for t in targets[start : start + k - 1]]
        if i == 3:
            want[2] = (want[2] + 1) % vocab  # rejected at the third draft
        drafts.append(DraftRows(want))
        start += k
    fused = rejection_sample(s, logits, rows, drafts, mask)

    class General(Sampler):
        def greedy_tokens(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return None

    general = rejection_sample(General(vocab, [0]), logits, rows, drafts, mask)
    assert fused == general
    # the rows read in place from a larger batch (`greedy_verify`): the same walk; a general sampler declines
    spread = torch.randperm(n + 5, generator=g)[:n]
    batch = torch.zeros(n + 5, 3008, dtype=logits.dtype)
    batch[spread] = logits
    assert greedy_verify(s, batch, spread, rows, drafts, mask) == fused
    assert greedy_verify(General(vocab, [0]), batch, spread, rows, drafts, mask) is None
    assert fused[2].dead and fused[2].tokens == drafts[2].draft_token_ids[:2]
    assert len(fused[3].tokens) == 3 and not fused[3].dead
