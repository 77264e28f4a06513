"""K-quant decode tiles, narrow (one 16-lane group a tile) against wide (four / two), by row length.

Single quantized projections of a few N x K shapes at one (or `--rows`) row, each over enough copies that every call
streams its weight from DRAM, timed with the kernels' narrow tiles on and off in turn, the order swapped every round
(`quant_set_narrow_kquant_tiles`; `gemm_plan.decode_tile_plan` makes the same choice once per CPU). Narrow tiles apply
only to rows of at most 24 KB a group (csrc/quant_ops.cpp: kNarrowMaxGroupBytes), so longer rows run the same code
both ways: their ratio is the spread of equal code. Prints GB/s of weight read, medians over the rounds. Run alone on
the machine (docs/benchmarks.md, the MoE section, "K-quant decode tiles of one lane group").

Usage: python scripts/bench_decode_tiles.py [--rounds 5] [--rows 1] [--formats Q4_K,Q6_K] [--shapes 16384x768,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from bench_quant_kernels import copies, random_quantized  # type: ignore[import-not-found]

from tandem.bench.common import machine_line
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import QuantProjection, quant_isa

SHAPES = "16384x768,8192x2048,4096x4096,2048x14336"


def gbps(projs: list[QuantProjection], x: torch.Tensor, calls: int = 3) -> float:
    """Weight bytes read per second, one pass over every copy a call."""
    for p in projs:
        p(x)
    t = time.perf_counter()
    for _ in range(calls):
        for p in projs:
            p(x)
    return projs[0].nbytes * len(projs) * calls / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default=SHAPES, help="N x K, comma-separated")
    args = ap.parse_args()
    if args.rounds < 1 or args.rows < 1:
        raise SystemExit(f"--rounds and --rows must be >= 1, got {args.rounds} and {args.rows}")
    if not load_cpu_kernels() or quant_isa() < 2:
        raise SystemExit("narrow tiles are an AVX512 choice: this CPU or build has no AVX512-VNNI quantized kernels")
    rng = np.random.default_rng(0)
    cases = {}
    for qtype in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            projs = [QuantProjection([random_quantized(qtype, n, k, rng)], None, 2) for _ in range(copies(n * k // 2))]
            cases[f"{qtype} {n} x {k}"] = (projs, torch.randn(args.rows, k))
    print(f"machine: {machine_line()}; threads {torch.get_num_threads()}; {args.rows} row(s)")
    rates: dict[str, dict[bool, list[float]]] = {name: {True: [], False: []} for name in cases}
    before = torch.ops.tandem.quant_set_narrow_kquant_tiles(False)
    try:
        for r in range(args.rounds):
            for narrow in (True, False) if r % 2 == 0 else (False, True):
                torch.ops.tandem.quant_set_narrow_kquant_tiles(narrow)
                for name, (projs, x) in cases.items():
                    rates[name][narrow].append(gbps(projs, x))
    finally:
        torch.ops.tandem.quant_set_narrow_kquant_tiles(before)
    for name, by in rates.items():
        narrow, wide = statistics.median(by[True]), statistics.median(by[False])
        print(f"{name:22s} narrow {narrow:5.1f} GB/s  wide {wide:5.1f} GB/s  narrow / wide {narrow / wide:.2f}")


if __name__ == "__main__":
    main()
