from __future__ import annotations

import pytest
import torch
import xgrammar

from tandem.sampling.bitmask import apply_token_bitmask_, bitmask_words, unpack_token_bitmask


def _random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Full int32 range, so bit 31 (negative words) is exercised.
    return torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("vocab, words", [(1, 1), (31, 1), (32, 1), (33, 2), (100, 4), (32000, 1000)])
def test_bitmask_words_is_ceil_v_over_32(vocab: int, words: int) -> None:
    assert bitmask_words(vocab) == words
    assert xgrammar.get_bitmask_shape(1, vocab) == (1, words)


def test_bit_j_of_word_w_allows_token_32w_plus_j() -> None:
    vocab = 70
    bitmask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = 1 | (1 << 5)  # tokens 0 and 5
    bitmask[0, 1] = -(2**31)  # bit 31 of word 1: token 63
    bitmask[1, 2] = 1 << 5  # token 69
    logits = torch.zeros(2, vocab)
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 5, 63]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [69]


@pytest.mark.parametrize("vocab", [100, 128, 257])
def test_matches_xgrammar_on_random_masks(vocab: int) -> None:
    bitmask = _random_bitmask(6, bitmask_words(vocab), seed=vocab)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits).any() and torch.isfinite(logits).any()


def test_rows_select_which_logits_rows_each_bitmask_row_masks() -> None:
    vocab = 90
    bitmask = _random_bitmask(2, bitmask_words(vocab), seed=7)
    logits = torch.randn(5, vocab)
    original = logits.clone()
    apply_token_bitmask_(logits, bitmask, rows=torch.tensor([3, 1]))
    # xgrammar's `indices` address logits and bitmask rows alike, so lay our rows out at those indices.
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[3], full[1] = bitmask[0], bitmask[1]
    expected = original.clone()
    xgrammar.apply_token_bitmask_inplace(expected, full, indices=[3, 1])
    assert torch.equal(logits, expected)
    for untouched in (0, 2, 4):
        assert torch.equal(logits[untouched], original[untouched])


def test_tokens_beyond_the_mask_are_disallowed() -> None:
    logits = torch.zeros(1, 40)
    apply_token_bitmask_(logits, torch.full((1, 1), -1, dtype=torch.int32))  # covers tokens 0..31 only
    assert torch.isfinite(logits[0, :32]).all()
    assert torch.isneginf(logits[0, 32:]).all()


def test_extra_words_beyond_the_vocabulary_are_ignored() -> None:
    allowed = unpack_token_bitmask(torch.full((2, 4), -1, dtype=torch.int32), vocab_size=50)
    assert allowed.shape == (2, 50) and allowed.all()


def test_mismatched_rows_raise() -> None:
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32), rows=torch.tensor([0]))


def test_works_on_half_precision_logits() -> None:
    logits = torch.zeros(1, 64, dtype=torch.bfloat16)
    mask = torch.tensor([[0b1010, 0]], dtype=torch.int32)
    apply_token_bitmask_(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3]
