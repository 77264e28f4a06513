"""Batch-1 decode two ways, alternating in one process on one loaded model, so that the two share the file, the page
cache and the moment (this VM's memory bandwidth moves by up to 1.5x between runs minutes apart; alternation in one
process is the fair comparison).

By default the two ways are the model's decode stack (`layers/decode_stack.py`) and the Python layer loop (the stack
set aside); `--rows-silu` also gives the loop the SiLU rule of before the MoE stack (torch's SiLU from 8 rows, so a
MoE decode step's 8 pairs ran torch's three operations): the loop as it was. `--tiles` compares instead the K-quant
decode tiles, narrow (one lane group a tile) against wide (`gemm_plan.decode_tile_plan`), both through the stack.
Each round generates `--tokens` greedy tokens after a one-token prompt each way, the first of the two alternating
between rounds. Prints each round's ms a step and the ratio. Run alone on the machine (docs/benchmarks.md, the MoE
section).

Usage: python scripts/ab_decode_stack.py MODEL.gguf [--rounds 20] [--tokens 16] [--dtype float32] [--rows-silu | --tiles]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench.common import machine_line
from tandem.layers import ops


def rows_silu(self: ops.CpuKernelOps, gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:  # noqa: ARG001
    """The SiLU rule before the MoE stack: by gu's rows, whatever the step's tokens."""
    if gu.shape[0] >= ops.SILU_KERNEL_MAX_ROWS:
        g, u = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u
    return torch.ops.tandem.silu_mul(gu)


def ms_a_step(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1000]}], params, use_tqdm=False)
    return (time.perf_counter() - t) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    way = ap.add_mutually_exclusive_group()
    way.add_argument("--rows-silu", action="store_true", help="the loop with the SiLU rule of before (rows, not tokens)")
    way.add_argument("--tiles", action="store_true", help="narrow against wide K-quant decode tiles, both in the stack")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 1:
        raise SystemExit(f"--rounds and --tokens must be >= 1, got {args.rounds} and {args.tokens}")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, progress=False)
    model = llm.llm_engine.runner.model
    stack = model.decode_stack
    if stack is None and not args.tiles:
        raise SystemExit("this model has no decode stack here (TANDEM_DECODE_STACK=0, or a part without a C++ call)")
    silu = ops.CpuKernelOps.silu_mul

    def use(first: bool) -> None:
        """The first way (stack / narrow tiles) or the second (loop / wide tiles)."""
        ops.CpuKernelOps.silu_mul = silu  # type: ignore[method-assign]
        if args.tiles:
            torch.ops.tandem.quant_set_narrow_kquant_tiles(first)
            return
        model.decode_stack = stack if first else None
        if args.rows_silu and not first:
            ops.CpuKernelOps.silu_mul = rows_silu  # type: ignore[method-assign]

    names = ("narrow", "wide") if args.tiles else ("stack", "loop")
    ms_a_step(llm, 8)  # warm-up
    print(f"machine: {machine_line()}")
    ratios = []
    for r in range(args.rounds):
        times = {}
        for first in (True, False) if r % 2 == 0 else (False, True):  # which goes first alternates: drifts cancel
            use(first)
            times[first] = ms_a_step(llm, args.tokens)
        use(True)
        ratios.append(times[False] / times[True])
        print(f"round {r + 1}: {names[0]} {times[True]:7.2f} ms a step, {names[1]} {times[False]:7.2f}: "
              f"{names[1]} / {names[0]} {ratios[-1]:.3f}")
    print(f"median {names[1]} / {names[0]}: {statistics.median(ratios):.3f} ({names[0]} faster in "
          f"{sum(x > 1 for x in ratios)} of {len(ratios)})")
    llm.shutdown()


if __name__ == "__main__":
    main()
