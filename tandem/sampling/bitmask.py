"""Grammar token bitmasks: packed int32 words, one bit per vocabulary token (the xgrammar / llguidance layout).

Bit `j` (little-endian: `(word >> j) & 1`) of word `w` set means token `32 * w + j` is allowed. A row of `W` words
covers tokens `[0, 32 * W)`; tokens at or beyond `32 * W` have no bit and are disallowed.
"""

from __future__ import annotations

import torch
from torch import Tensor

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """The number of int32 words a bitmask row needs to cover `vocab_size` tokens: ceil(V / 32)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def unpack_token_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """The allowed-token mask `[R, vocab_size]` (bool) of a packed bitmask `[R, W]` (int32); changes nothing.

    Tokens beyond the `32 * W` the mask covers come out False (disallowed).
    """
    num_rows, num_words = bitmask.shape
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # [32]
    # Arithmetic right shift then & 1 reads bit j, also for bit 31 of a negative word.
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(num_rows, num_words * BITS_PER_WORD).bool()  # [R, 32 * W]
    covered = min(vocab_size, num_words * BITS_PER_WORD)
    if covered == vocab_size:
        return allowed[:, :vocab_size]
    out = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=bitmask.device)  # [R, V]
    out[:, :covered] = allowed[:, :covered]
    return out


def apply_token_bitmask_(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [R, V] float. bitmask: [B, W] int32 (on any device; moved to the logits' device).
    rows: optional [B] indices into the logits' rows; bitmask row `i` applies to logits row `rows[i]`. Without
    `rows`, B must equal R and bitmask row `i` applies to logits row `i`. Tokens not covered by the mask
    (>= 32 * W) are disallowed.
    """
    vocab_size = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda and _triton_kernel() is not None:
        _check_rows(bitmask, logits, rows)
        rows_t = None if rows is None else torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        _triton_kernel()(logits, bitmask, rows_t)  # type: ignore[misc]
        return
    disallowed = ~unpack_token_bitmask(bitmask, vocab_size)  # [B, V]
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}; pass `rows`")
        logits.masked_fill_(disallowed, float("-inf"))
        return
    rows = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)  # [B]
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows but `rows` names {rows.shape[0]}")
    selected = logits.index_select(0, rows)  # [B, V]
    selected.masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, rows, selected)


def _check_rows(bitmask: Tensor, logits: Tensor, rows: Tensor | None) -> None:
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}; pass `rows`")
    if rows is not None and len(rows) != bitmask.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows but `rows` names {len(rows)}")


def _triton_kernel():  # type: ignore[no-untyped-def]
    """The one-kernel path (tandem/sampling/bitmask_triton.py) where Triton is installed, else None."""
    global _KERNEL
    if _KERNEL is False:
        try:
            from tandem.sampling.bitmask_triton import apply_token_bitmask_triton_

            _KERNEL = apply_token_bitmask_triton_
        except ImportError:
            _KERNEL = None
    return _KERNEL


_KERNEL: object = False  # not looked up yet
