"""Projections: a row's result does not depend on how many rows run with it (bf16: tandem's GEMM and oneDNN
bitwise; float32 oneDNN within rounding, its one-row kernel differs), and the row buckets that bound oneDNN's
per-shape code cache."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.linear import EXACT_ROWS, ROW_BUCKET, bucket_rows, make_linear

ROWS = (1, 3, 8, 9, 16, 17, 33)


def test_row_buckets() -> None:
    assert [bucket_rows(m) for m in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))  # exact up to 8
    for m in range(EXACT_ROWS + 1, 200):
        b = bucket_rows(m)
        assert b % ROW_BUCKET == 0 and m <= b < m + ROW_BUCKET
    assert len({bucket_rows(m) for m in range(1, 513)}) == EXACT_ROWS + 512 // ROW_BUCKET  # few shapes


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-gemm", "onednn"])
def test_bf16_rows_are_batch_invariant(kernels: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    f = make_linear(w, use_kernels=kernels)
    if kernels and f.kind != "bf16-gemm":
        pytest.skip("tandem's bf16 GEMM needs avx512_bf16, which this CPU lacks (the oneDNN case runs)")
    full = f(x)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, atol=0.05, rtol=1e-2)
    for m in ROWS:
        assert torch.equal(f(x[:m].contiguous()), full[:m]), m


def test_float32_rows_agree_within_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g), torch.randn(40, 64, generator=g)
    f = make_linear(w, use_kernels=False)
    full = f(x)
    torch.testing.assert_close(full, x @ w.T, atol=1e-5, rtol=1e-5)
    for m in ROWS:
        torch.testing.assert_close(f(x[:m].contiguous()), full[:m], atol=1e-5, rtol=1e-6)
