"""Dense projections, picked once per weight for the device and dtype.

On x86 CPUs `F.linear` on bfloat16 reaches about a third of memory bandwidth at batch 1, while oneDNN with a
pre-packed (blocked) weight reaches it fully; float32 through oneDNN is also ~2x MKL's path there. Everything else uses
`F.linear`. The packed weight replaces the plain one (weights are held once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor], torch.Tensor]

EXACT_ROWS = 8  # up to this many rows run as they are; more are padded to a multiple of ROW_BUCKET
ROW_BUCKET = 16


def bucket_rows(m: int) -> int:
    """oneDNN builds and caches code per input shape; bucketing the row count keeps that cache (and the RSS it
    holds) bounded by a few hundred shapes instead of growing with every new batch size."""
    return m if m <= EXACT_ROWS else -(-m // ROW_BUCKET) * ROW_BUCKET


def _onednn_available(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(2, 16, dtype=dtype)
        packed = _pack(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def _pack(w: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    return w  # float32: oneDNN takes the plain [out, in] weight


_ONEDNN: dict[torch.dtype, bool] = {}


def _bf16_gemm_available() -> bool:
    from tandem.layers.kernels import load_cpu_kernels

    return load_cpu_kernels() and bool(torch.ops.tandem.has_bf16_gemm())


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, use_kernels: bool = False) -> LinearFn:
    """A function x [..., in] -> [..., out] computing x @ weight.T + bias with the fastest kernel for the device.

    bf16 on an AVX512-BF16 CPU with `use_kernels`: tandem's GEMM (`csrc/cpu_ops.cpp: linear_bf16`), 1.1-1.3x
    oneDNN at 32 rows and up to 2-3x at 1-5 rows, same for prefill; every row computed the same way at any batch size.
    """
    dtype = weight.dtype
    N, K = weight.shape
    if (
        use_kernels and weight.device.type == "cpu" and dtype == torch.bfloat16 and N % 16 == 0 and K % 2 == 0
        and (bias is None or bias.dtype == torch.bfloat16) and _bf16_gemm_available()
    ):
        # [N, K] -> [N / 16, K / 2, 16, 2]: per 16 output columns, K in pairs (the vdpbf16ps operand layout)
        packed_w = weight.reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()
        kb = bias.contiguous() if bias is not None else None
        gemm = torch.ops.tandem.linear_bf16

        def kernel_linear(x: torch.Tensor) -> torch.Tensor:
            return gemm(x.contiguous(), packed_w, kb)

        return kernel_linear
    if weight.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        ok = _ONEDNN.get(dtype)
        if ok is None:
            ok = _ONEDNN[dtype] = _onednn_available(dtype)
        if ok:
            packed = _pack(weight.contiguous())
            op = torch.ops.mkldnn._linear_pointwise
            b = bias.contiguous() if bias is not None else None

            def onednn_linear(x: torch.Tensor) -> torch.Tensor:
                m = x.shape[0]
                padded = bucket_rows(m)
                if padded == m:
                    return op(x, packed, b, "none", [], "")
                return op(F.pad(x, (0, 0, 0, padded - m)), packed, b, "none", [], "")[:m]

            return onednn_linear
    w, b2 = weight, bias

    def plain_linear(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b2)

    return plain_linear
