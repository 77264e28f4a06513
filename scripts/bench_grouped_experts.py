"""A mixture-of-experts layer's expert kernels at batch 1 against one large projection of the same kernels.

Random Qwen3-30B-A3B-shaped experts (gate / up [2 I, hidden] Q4_K, down [hidden, I] Q6_K, as a Q4_K_M file mixes
them), enough of them that the k chosen per call come from DRAM, run through `GroupedProjections` (one
`quant_grouped` call for the chosen gate / ups, one for their downs) as `MoeMlp` runs them for one token; then single
`QuantProjection`s of a few shapes, over enough copies that each call streams its weight from DRAM. Prints ms and
GB/s of weight read. Run alone on the machine (docs/benchmarks.md, the MoE section).

Usage: python scripts/bench_grouped_experts.py [--experts 128] [--k 8] [--hidden 2048] [--inter 768] [--calls 200]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from bench_quant_kernels import copies, random_quantized  # type: ignore[import-not-found]

from tandem.bench.common import machine_line
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import GroupedProjections, QuantProjection

BEST_ISA = 0  # the kernels pick the best ISA this CPU has (AVX512-VNNI, else AVX2)


def best_s(fn: Callable[[], object], calls: int, rounds: int = 3) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    assert load_cpu_kernels(), "tandem's CPU kernels did not build here"
    print(f"machine: {machine_line()}; threads {torch.get_num_threads()}")
    rng, pick = np.random.default_rng(0), random.Random(0)
    h, i, k = args.hidden, args.inter, args.k
    gate_ups = GroupedProjections([QuantProjection([random_quantized("Q4_K", 2 * i, h, rng)], None, BEST_ISA)
                                   for _ in range(args.experts)])
    downs = GroupedProjections([QuantProjection([random_quantized("Q6_K", h, i, rng)], None, BEST_ISA)
                                for _ in range(args.experts)])
    gu_bytes, down_bytes = gate_ups.projections[0].nbytes, downs.projections[0].nbytes
    x_h, x_i = torch.randn(k, h), torch.randn(k, i)  # one token's row for each of its k experts

    def layer() -> object:
        chosen = sorted(pick.sample(range(args.experts), k))
        y = gate_ups(x_h, chosen, [1] * k)
        return downs(y[:, :i].contiguous(), chosen, [1] * k)

    rows = [("layer (gate / up, then down)", best_s(layer, args.calls), k * (gu_bytes + down_bytes)),
            ("gate / up call", best_s(lambda: gate_ups(x_h, sorted(pick.sample(range(args.experts), k)), [1] * k), args.calls), k * gu_bytes),
            ("down call", best_s(lambda: downs(x_i, sorted(pick.sample(range(args.experts), k)), [1] * k), args.calls), k * down_bytes)]
    for qtype, n, kk in (("Q4_K", 16384, h), ("Q4_K", 8192, h), ("Q4_K", 16384, i), ("Q6_K", 16384, i)):
        projs = [QuantProjection([random_quantized(qtype, n, kk, rng)], None, BEST_ISA) for _ in range(copies(n * kk // 2))]
        x = torch.randn(1, kk)
        s = best_s(lambda projs=projs, x=x: [p(x) for p in projs], 3) / len(projs)
        rows.append((f"one {qtype} projection {n} x {kk}", s, projs[0].nbytes))
    for name, s, nbytes in rows:
        print(f"{name:36s} {s * 1e3:7.3f} ms  {nbytes / s / 1e9:5.1f} GB/s  ({nbytes / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
