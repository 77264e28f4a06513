"""The grammar bitmask applied by one Triton kernel on an accelerator: each program reads the packed words of a
block of tokens of one row and writes -inf where a token's bit is clear, in place (one pass, no unpacked [R, V]
intermediates; the torch path in bitmask.py takes ~6 ops and two [R, V] temporaries)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, num_words, logits_stride, bitmask_stride,
                          HAS_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    words = tokens // 32
    packed = tl.load(bitmask_ptr + r * bitmask_stride + words, mask=words < num_words, other=0)
    allowed = ((packed >> (tokens % 32)) & 1) != 0
    row = tl.load(rows_ptr + r) if HAS_ROWS else r
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=(tokens < vocab_size) & ~allowed)


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """`apply_token_bitmask_` in one kernel. logits [R, V] (last dim contiguous), bitmask [B, W] int32 on the same
    device, rows [B] long or None (then B == R). Tokens beyond 32 * W are disallowed."""
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary dimension")
    bitmask = bitmask.contiguous()
    num_rows, num_words = bitmask.shape
    vocab = logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    rows_arg = rows.to(torch.int64).contiguous() if rows is not None else bitmask  # unread without HAS_ROWS
    _apply_bitmask_kernel[grid](logits, bitmask, rows_arg, vocab, num_words, logits.stride(0), bitmask.stride(0),
                                HAS_ROWS=rows is not None, BLOCK_SIZE=BLOCK)
