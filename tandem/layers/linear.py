"""Projections: a weight held once, in the layout its kernel reads, picked once per weight for the device and format.

`make_linear(weight)` returns a `Projection`, a callable x [M, K] -> x @ W^T + b [M, N] that can also hand out rows of
W (`rows(ids)`, float32): a tied embedding is looked up from the same storage the output projection multiplies, so it
is held once. Kinds, on the CPU with tandem's kernels:
  * `QuantProjection`: quantized weights (GGUF blocks, int8) repacked losslessly for `csrc/quant_ops.cpp` (VNNI or
    AVX2 integer dot products over int8-quantized activations); one call runs a fused group of parts of mixed formats.
  * `Bf16GemmProjection`: bf16 weights packed once for tandem's GEMM (`csrc/cpu_ops.cpp: linear_bf16`), which runs
    on AVX512-BF16 or on AMX tiles over that same packing, as `gemm_plan.bf16_plan()` measured for this CPU; on a
    CPU with neither, AVX2 / FMA over the same packing, bf16 widened to float32 in registers.
  * `OneDnnProjection`: bf16 / float32 weights pre-packed for oneDNN (x86 `F.linear` on bf16 reaches a third of the
    memory bandwidth at batch 1; oneDNN with a packed weight all of it).
  * `DenseProjection`: `F.linear` (accelerators, anything else). Quantized weights on an accelerator, or without the
    kernels, are dequantized once with torch ops on their device (`QuantizedTensor.dequantize`).

`GroupedProjections` runs many projections of one K over their own groups of rows (a layer's experts): one kernel
call when all of them are quantized for tandem's kernels, one call each otherwise.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.layers.quant import QuantizedTensor, concat_rows

logger = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]
Weight = torch.Tensor | QuantizedTensor  # noqa: UP007 (a runtime alias on Python 3.10)

EXACT_ROWS = 8  # up to this many rows run as they are; more are padded to a multiple of ROW_BUCKET
ROW_BUCKET = 16
ISA_ENV = "TANDEM_QUANT_ISA"  # "avx2" forces the quantized kernels' AVX2 path (tests), "avx512" the VNNI one
_ISAS = {"auto": 0, "avx2": 1, "avx512": 2}


def bucket_rows(m: int) -> int:
    """oneDNN builds and caches code per input shape; bucketing the row count keeps that cache (and the RSS it
    holds) bounded by a few hundred shapes instead of growing with every new batch size."""
    return m if m <= EXACT_ROWS else -(-m // ROW_BUCKET) * ROW_BUCKET


class Projection(ABC):
    """x [M, K] -> x @ W^T (+ b) [M, N] in x's dtype; W held once, in the layout its kernel reads."""

    out_features: int
    in_features: int
    kind: str

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    has_rows = True  # whether `rows` can read W back (not from oneDNN's opaque bf16 packing)

    @abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as float32 [len(ids), K] (embedding lookups from the projection's own storage)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight (and bias) occupy."""

    def kernel_segments(self) -> KernelSegments | None:
        """The weight as tandem's quantized kernels hold it, for calls grouping many projections; None if it is not."""
        return None

    def stack_entry(self) -> StackEntry | None:
        """This projection's kernel call as a `DecodeStack` makes it from C++; None when it is not one of tandem's
        CPU kernels (oneDNN, torch)."""
        return None


@dataclass(frozen=True)
class StackEntry:
    """A projection's kernel call as plain arguments of `DecodeStack.add_projection` (csrc/decode_stack.cpp): kind 0
    is `quant_linear(x, packed, formats, ns, bias, isa, amx_rows)`, kind 1 `linear_bf16(x, packed[0], bias, amx_rows)`."""

    kind: int
    packed: list[torch.Tensor]
    formats: list[int]
    ns: list[int]
    bias: torch.Tensor | None
    isa: int
    amx_rows: int


@dataclass(frozen=True)
class KernelSegments:
    """A `QuantProjection`'s packed parts: part i is `packed[i]` in format `formats[i]`, `ns[i]` output columns wide,
    stacked along N in order; `biases[i]` float32 [ns[i]] or None; `isa` / `amx_rows` as the projection calls."""

    packed: tuple[torch.Tensor, ...]
    formats: tuple[int, ...]
    ns: tuple[int, ...]
    biases: tuple[torch.Tensor | None, ...]
    isa: int
    amx_rows: int


class DenseProjection(Projection):
    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight) + _tensor_bytes(self.bias)


class OneDnnProjection(Projection):
    """bf16 / float32 through oneDNN with a pre-packed weight. The bf16 packing is opaque, so `rows` is only
    available for float32 (whose packed weight is the plain one); a tied bf16 embedding keeps its own table."""

    kind = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.packed = _pack_onednn(weight.contiguous())
        self.has_rows = self.packed.dtype == torch.float32
        self.bias = bias.contiguous() if bias is not None else None
        self._op = torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        padded = bucket_rows(m)
        if padded == m:
            return self._op(x, self.packed, self.bias, "none", [], "")
        return self._op(F.pad(x, (0, 0, 0, padded - m)), self.packed, self.bias, "none", [], "")[:m]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.has_rows:
            raise TypeError("a oneDNN-packed bf16 weight has no readable rows (callers check has_rows)")
        return F.embedding(ids, self.packed).float()

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.packed) + _tensor_bytes(self.bias)


class Bf16GemmProjection(Projection):
    """tandem's bf16 GEMM over W packed [N / 16, K / 2, 16, 2], the operand layout of both `vdpbf16ps` and an AMX B
    tile. AVX512-BF16: 1.1-1.3x oneDNN at 32 rows and 2-3x at 1-5 rows (AMD EPYC); AMX tiles where the CPU has them
    and `bf16_plan()` chose them; AVX2 / FMA (widened to float32) on a CPU without AVX512-BF16: 1.7-2x torch's bf16
    `F.linear` at 1 row, 6-9x from 8 (AMD EPYC Zen 3). Either way every row is computed the same way at any batch size."""

    kind = "bf16-gemm"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        from tandem.layers.gemm_plan import bf16_plan

        n, k = int(weight.shape[0]), int(weight.shape[1])
        self.out_features, self.in_features = n, k
        # [N, K] -> [N / 16, K / 2, 16, 2]: per 16 output columns, K in pairs (the vdpbf16ps operand layout)
        self.packed = weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.amx_rows = bf16_plan().amx_rows  # linear_bf16: calls of at least this many rows on AMX (0: never)
        self._gemm = torch.ops.tandem.linear_bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x.contiguous(), self.packed, self.bias, self.amx_rows)

    def stack_entry(self) -> StackEntry | None:
        return StackEntry(1, [self.packed], [], [], self.bias, 0, self.amx_rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.packed[ids // 16, :, ids % 16, :]  # [R, K / 2, 2]
        return picked.reshape(ids.shape[0], self.in_features).float()

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.packed) + _tensor_bytes(self.bias)


class QuantProjection(Projection):
    """Quantized parts (one format each, same K) multiplied in one kernel call into one output [M, sum(N_i)]."""

    kind = "quant"

    def __init__(self, parts: Sequence[QuantizedTensor], bias: torch.Tensor | None, isa: int) -> None:
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.formats = [p.format.kernel_id for p in parts]
        self.ns = [p.shape[0] for p in parts]
        self.packed = [_pack_quant(p) for p in parts]
        self.qtypes = [p.qtype for p in parts]
        self.bias = bias.float().contiguous() if bias is not None else None
        self.isa = isa
        # Q8_0 / I8 segments on AMX int8 tiles from this many rows (0: never; same results either way)
        self.amx_rows = _int8_amx_rows(self.qtypes) if isa == 2 else 0
        if isa == 2 and any(q in KQUANTS for q in self.qtypes):
            from tandem.layers.gemm_plan import decode_tile_plan

            decode_tile_plan()  # this CPU's K-quant decode tile shape, set in the kernels (measured once per CPU)
        self._op = torch.ops.tandem.quant_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.packed, self.formats, self.ns, self.bias, self.isa, self.amx_rows)

    @property
    def has_rows(self) -> bool:  # type: ignore[override]
        return len(self.packed) == 1

    def stack_entry(self) -> StackEntry | None:
        return StackEntry(0, list(self.packed), list(self.formats), list(self.ns), self.bias, self.isa, self.amx_rows)

    def kernel_segments(self) -> KernelSegments:
        starts = [sum(self.ns[:i]) for i in range(len(self.ns))]
        biases = tuple(None if self.bias is None else self.bias[a : a + n] for a, n in zip(starts, self.ns))
        return KernelSegments(tuple(self.packed), tuple(self.formats), tuple(self.ns), biases, self.isa, self.amx_rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.packed) != 1:
            raise TypeError("a fused projection has no single table of rows (callers check has_rows)")
        return torch.ops.tandem.quant_rows(self.packed[0], self.formats[0], self.ns[0], self.in_features, ids)

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(p) for p in self.packed) + _tensor_bytes(self.bias)


class GroupedProjections:
    """Projections of one K (a layer's experts' gate / up, or their downs) each run over its own group of rows.

    `(x, chosen, counts)`: x [M, K] holds the rows of projection `chosen[0]` first (`counts[0]` of them), then those of
    `chosen[1]`, ...; returns [M, N] with each row multiplied by its own group's weight. When every projection is
    quantized for tandem's kernels (`kernel_segments`), the whole call is one `quant_grouped`: the activations
    quantized once, one parallel region over every chosen weight's strips (llama.cpp's `mul_mat_id`). Measured on two
    AVX-512 cores, Qwen3-30B-A3B's experts at batch 1: one call per expert cost ~250 us each, most of it the
    per-call quantization and parallel region, so 8 layers' 64 experts streamed at 2.7 GB/s. Otherwise each chosen
    projection is called on its rows. Either way a row's result is what its projection alone gives it.
    """

    def __init__(self, projections: Sequence[Projection]) -> None:
        self.projections = list(projections)
        found = [p.kernel_segments() for p in self.projections]
        ready = [s for s in found if s is not None]
        one_kernel = len(ready) == len(found) and len({(s.isa, s.amx_rows) for s in ready}) == 1
        self.segments: list[KernelSegments] | None = ready if one_kernel else None
        self.out_features = self.projections[0].out_features

    def __call__(self, x: torch.Tensor, chosen: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """x [M, K] grouped as described -> [M, N] in x's dtype."""
        if self.segments is None:
            return torch.cat([self.projections[e](x[a : a + n]) for e, a, n in _groups(chosen, counts)])
        packed: list[torch.Tensor] = []
        formats: list[int] = []
        ns: list[int] = []
        cols: list[int] = []
        row0: list[int] = []
        row1: list[int] = []
        biases: list[torch.Tensor] = []
        for e, a, n in _groups(chosen, counts):
            seg = self.segments[e]
            col = 0
            for i, width in enumerate(seg.ns):
                packed.append(seg.packed[i])
                formats.append(seg.formats[i])
                ns.append(width)
                cols.append(col)
                row0.append(a)
                row1.append(a + n)
                bias = seg.biases[i]
                if bias is not None:
                    biases.append(bias)
                col += width
        if biases and len(biases) != len(packed):
            raise ValueError("grouped projections must all have biases or none")
        first = self.segments[0]
        return torch.ops.tandem.quant_grouped(x.contiguous(), packed, formats, ns, cols, row0, row1, biases, first.isa,
                                              first.amx_rows)


def _groups(chosen: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(projection, first row, rows) of each group with rows."""
    out, start = [], 0
    for e, n in zip(chosen, counts):
        if n:
            out.append((e, start, n))
        start += n
    return out


def _int8_amx_rows(qtypes: Sequence[str]) -> int:
    if not any(q in ("Q8_0", "I8") for q in qtypes):
        return 0
    from tandem.layers.gemm_plan import int8_plan

    return int8_plan().amx_rows


KQUANTS = ("Q4_K", "Q5_K", "Q6_K")  # the formats whose one- and two-row tiles decode_tile_plan shapes


def make_linear(
    weight: Weight | Sequence[Weight], bias: torch.Tensor | None = None, use_kernels: bool = False,
    dtype: torch.dtype | None = None,
) -> Projection:
    """The projection for `weight` (or the parts of a fused one, stacked along N) with the fastest kernel for the
    device and format. Quantized parts stay quantized on a CPU with the kernels; otherwise they are dequantized to
    `dtype` (default: the dense parts' dtype, else bfloat16) on their device. The inputs can be dropped afterwards."""
    parts = list(weight) if isinstance(weight, Sequence) else [weight]
    quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
    dense_dtype = dtype or next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.bfloat16)
    if quantized:
        isa = quant_isa() if use_kernels and parts[0].device.type == "cpu" else 0
        # the kernels quantize activations in blocks of 32 (I8 included): other widths run dense
        if isa and len(quantized) == len(parts) and parts[0].shape[1] % 32 == 0:
            return QuantProjection(_merge_same_format(quantized), bias, isa)
        parts = [p.dequantize(dense_dtype) if isinstance(p, QuantizedTensor) else p for p in parts]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
    return _dense_projection(w, bias, use_kernels)  # type: ignore[arg-type]


def _dense_projection(weight: torch.Tensor, bias: torch.Tensor | None, use_kernels: bool) -> Projection:
    n, k = weight.shape
    on_cpu = weight.device.type == "cpu"
    if (
        use_kernels and on_cpu and weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 2 == 0
        and (bias is None or bias.dtype == torch.bfloat16) and _bf16_gemm_available()
    ):
        return Bf16GemmProjection(weight, bias)
    if on_cpu and weight.dtype in (torch.bfloat16, torch.float32) and _onednn_ok(weight.dtype):
        return OneDnnProjection(weight, bias)
    return DenseProjection(weight, bias)


def _merge_same_format(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Adjacent parts of one format become one segment (fewer, longer strips for the kernel)."""
    merged: list[list[QuantizedTensor]] = []
    for p in parts:
        if merged and merged[-1][0].qtype == p.qtype:
            merged[-1].append(p)
        else:
            merged.append([p])
    return [group[0] if len(group) == 1 else concat_rows(group) for group in merged]


def _pack_quant(w: QuantizedTensor) -> torch.Tensor:
    n, k = w.shape
    if w.qtype == "I8":
        assert w.scales is not None
        return torch.ops.tandem.quant_pack_i8(w.data.contiguous(), w.scales.float().contiguous())
    return torch.ops.tandem.quant_pack(w.data.contiguous(), w.format.kernel_id, n, k)


def quant_isa() -> int:
    """The quantized kernels' ISA: 2 AVX512-VNNI, 1 AVX2, 0 none (no kernels, or a CPU with neither);
    `TANDEM_QUANT_ISA=avx2` forces the AVX2 path on a VNNI CPU."""
    from tandem.layers.kernels import load_cpu_kernels

    if not load_cpu_kernels():
        return 0
    best = int(torch.ops.tandem.quant_isa())
    wanted = _ISAS.get(os.environ.get(ISA_ENV, "auto").lower(), 0)
    if wanted and wanted > best:
        logger.warning("%s=%s: this CPU only has ISA level %d; using it", ISA_ENV, os.environ[ISA_ENV], best)
    return min(wanted, best) if wanted else best


def kernel_paths() -> dict[str, str]:
    """The CPU path each weight format takes here (what `make_linear` picks for a CPU weight with the kernels on):
    for benchmarks' machine lines and the dispatch test."""
    if _bf16_gemm_available():
        from tandem.layers.gemm_plan import bf16_plan

        bf16 = {"amx": "tandem amx-bf16 tiles", "avx512-bf16": "tandem avx512-bf16 gemm",
                "avx2-fma": "tandem avx2-fma gemm (bf16 widened to float32)"}.get(
            bf16_plan().path, f"tandem {bf16_plan().path}")
    else:
        bf16 = "onednn" if _onednn_ok(torch.bfloat16) else "torch"
    quant = {2: "avx512-vnni", 1: "avx2"}.get(quant_isa(), "dequantized to bf16")
    if quant == "avx512-vnni":
        from tandem.layers.gemm_plan import decode_tile_plan, int8_plan

        rows = int8_plan().amx_rows
        quant += f" (Q8_0 / I8 on amx-int8 tiles from {rows} rows)" if rows else ""
        quant += "; K-quant decode tiles " + ("narrow" if decode_tile_plan().narrow else "wide")
    return {"bf16": bf16, "quantized": quant}


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _onednn_available(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(2, 16, dtype=dtype)
        packed = _pack_onednn(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def _pack_onednn(w: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    return w  # float32: oneDNN takes the plain [out, in] weight


_ONEDNN: dict[torch.dtype, bool] = {}


def _onednn_ok(dtype: torch.dtype) -> bool:
    ok = _ONEDNN.get(dtype)
    if ok is None:
        ok = _ONEDNN[dtype] = _onednn_available(dtype)
    return ok


def _bf16_gemm_available() -> bool:
    from tandem.layers.kernels import load_cpu_kernels

    return load_cpu_kernels() and bool(torch.ops.tandem.has_bf16_gemm())
