"""Projection kernels on this CPU: tandem's bf16 GEMM and quantized kernels against torch's and torchao's CPU paths.

One projection of a real shape (default: SmolLM2-1.7B's gate/up, [16384, 2048]) at 1 ... 512 rows, best of several
calls over enough copies of the weight that each call reads it from memory, not from the last-level cache. Columns:
  bf16-avx512     tandem's bf16 GEMM on AVX512-BF16 (csrc/cpu_ops.cpp: linear_bf16)
  bf16-amx        the same GEMM on AMX tiles, same packed weight (CPUs with amx_bf16)
  bf16-avx2       the same GEMM on a CPU without AVX512-BF16: AVX2 / FMA, bf16 widened to float32 in registers
  onednn          oneDNN's bf16 matmul on a pre-packed weight (torch.ops.mkldnn; AMX where the CPU has it)
  F.linear        torch's bf16 F.linear
  F.linear-f32    torch's float32 F.linear on a float32 copy of the weight (twice the bytes; x widened in the call)
  torch-w8a16     torch._weight_int8pack_mm (int8 weights, per-channel scales, bf16 activations)
  torchao-*       torchao's Int8WeightOnly / Int8DynamicActivationInt8Weight configs on nn.Linear (when installed)
  Q8_0 ... I8     tandem's quantized kernels (csrc/quant_ops.cpp), int8 activation blocks, VNNI (or AVX2 with --isa avx2)
Usage: python scripts/bench_quant_kernels.py [--n 16384 --k 2048] [--rows 1,4,8,32,128,512] [--isa avx512]
                                            [--only bf16-avx512,bf16-amx,bf16-avx2,onednn,F.linear,F.linear-f32] [--gflops]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from tandem.bench.common import machine_line, print_table
from tandem.cpu_features import cpu_features
from tandem.layers.linear import Bf16GemmProjection, OneDnnProjection, QuantProjection
from tandem.layers.quant import FORMATS, QuantizedTensor, quantize_int8
from tandem.runner.tensor_thread import on_tensor_thread

L3_BYTES = 64 << 20  # copies of the weight add up to at least this much, so every call streams it from DRAM


def best_ms(fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, reps: int = 4) -> float:
    for f in fns[:2]:
        f(x)
    times = []
    for _ in range(reps):
        for f in fns:
            t = time.perf_counter()
            f(x)
            times.append(time.perf_counter() - t)
    return min(times) * 1e3


def copies(nbytes: int) -> int:
    return max(1, -(-L3_BYTES // max(nbytes, 1)))


def random_quantized(qtype: str, n: int, k: int, rng: np.random.Generator) -> QuantizedTensor:
    fmt = FORMATS[qtype]
    raw = rng.integers(0, 256, size=(n, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    halves = np.full(raw.shape[:2], 0.01, dtype=np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    offsets = {"Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}.get(qtype, [0])
    for off in offsets:
        raw[..., off : off + 2] = halves
    return QuantizedTensor(qtype, (n, k), torch.from_numpy(raw.reshape(n, -1)))


def torchao_linears(w: torch.Tensor, count: int) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    try:
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
    except ImportError:
        return {}
    out = {}
    for name, config in (("torchao-w8a16", Int8WeightOnlyConfig), ("torchao-w8a8", Int8DynamicActivationInt8WeightConfig)):
        mods = []
        for _ in range(count):
            m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            m.weight.data.copy_(w)
            quantize_(m, config())
            mods.append(m)
        out[name] = mods
    return out


BF16_COLUMNS = ("bf16-avx512", "bf16-amx", "bf16-avx2", "onednn", "F.linear", "F.linear-f32")


def bf16_candidates(w: torch.Tensor) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    from tandem.layers.kernels import load_cpu_kernels

    assert load_cpu_kernels(), "tandem's CPU kernels did not build here"
    c = copies(w.numel() * 2)
    cpu = cpu_features()
    out: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
    if cpu.has("avx512_bf16"):  # tandem's bf16 GEMM and oneDNN's packed bf16 weights need it (an AVX2 CPU: neither)
        gemm = torch.ops.tandem.linear_bf16
        packs = [Bf16GemmProjection(w.clone(), None).packed for _ in range(c)]
        out["bf16-avx512"] = [lambda x, p=p: gemm(x, p, None, 0) for p in packs]
        if torch.ops.tandem.has_amx_bf16():
            out["bf16-amx"] = [lambda x, p=p: gemm(x, p, None, 1) for p in packs]
        out["onednn"] = [OneDnnProjection(w.clone(), None) for _ in range(c)]
    elif torch.ops.tandem.bf16_gemm_isa() == 1:  # the AVX2 / FMA build of the same GEMM
        gemm = torch.ops.tandem.linear_bf16
        out["bf16-avx2"] = [lambda x, p=p: gemm(x, p, None, 0)
                            for p in (Bf16GemmProjection(w.clone(), None).packed for _ in range(c))]
    plain = [w.clone() for _ in range(c)]
    out["F.linear"] = [lambda x, p=p: torch.nn.functional.linear(x, p) for p in plain]
    wide = [w.float() for _ in range(c)]
    out["F.linear-f32"] = [lambda x, p=p: torch.nn.functional.linear(x.float(), p) for p in wide]
    return out


def candidates(n: int, k: int, isa: int, only: set[str]) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """The columns in `only` (all when empty), each group built only when one of its columns is asked for; a quant
    type whose block does not divide `k` is left out."""
    def wanted(*names: str) -> bool:
        return not only or any(name in only for name in names)

    rng = np.random.default_rng(0)
    w = (torch.randn(n, k) * 0.02).bfloat16()
    out = bf16_candidates(w) if wanted(*BF16_COLUMNS) else {}
    q8 = quantize_int8(w)
    if wanted("torch-w8a16"):
        packs = [(q8.data.clone(), q8.scales.bfloat16()) for _ in range(copies(n * k))]  # type: ignore[union-attr]
        out["torch-w8a16"] = [lambda x, p=p: torch._weight_int8pack_mm(x, p[0], p[1]) for p in packs]
    if wanted("torchao-w8a16", "torchao-w8a8"):
        with torch.no_grad():
            out.update({name: [lambda x, m=m: m(x) for m in mods]
                        for name, mods in torchao_linears(w, copies(n * k * 2)).items()})
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "I8"):
        if not wanted(qtype) or k % FORMATS[qtype].block:
            continue
        weight = q8 if qtype == "I8" else random_quantized(qtype, n, k, rng)
        out[qtype] = [QuantProjection([weight], None, isa) for _ in range(copies(weight.nbytes))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,4,8,32,128,512")
    ap.add_argument("--isa", default="avx512", choices=["avx512", "avx2"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--only", default="", help="comma-separated columns (default: all)")
    ap.add_argument("--gflops", action="store_true", help="GFLOP/s instead of ms per call")
    args = ap.parse_args()
    only = {c for c in args.only.split(",") if c}

    def run() -> list[dict[str, object]]:
        torch.set_num_threads(args.threads)
        fns = candidates(args.n, args.k, 2 if args.isa == "avx512" else 1, only)
        fns = {name: f for name, f in fns.items() if not only or name in only}
        rows = []
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, args.k).bfloat16()
            row: dict[str, object] = {"rows": m}
            with torch.no_grad():
                for name, f in fns.items():
                    ms = best_ms(f, x)
                    row[name] = round(2 * m * args.n * args.k / ms / 1e6) if args.gflops else round(ms, 3)
            rows.append(row)
        return rows

    unit = "GFLOP/s (best call)" if args.gflops else "ms per call (best)"
    print(f"{machine_line()}; threads {args.threads}; [{args.n}, {args.k}] projection, {unit}")
    print_table(on_tensor_thread(run))


if __name__ == "__main__":
    main()
