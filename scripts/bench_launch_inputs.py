"""Host time of a runner's launch inputs for one step: what the device waits for between sampling and the launch.

    python scripts/bench_launch_inputs.py [--rows 256] [--repeats 30] [--seed 0] [--cold]

Random decode plans (one token a row) and verify plans (0-4 drafts a row), positions 100-1500, 16-token blocks:
`step_inputs`, what `ModelRunner._inputs` builds (input ids, `build_metadata` for tandem's CPU kernels, the torch gathered path and
FlexAttention's paged path, logits rows) and the CUDA-graph step's padded inputs (`GraphedSteps._pad`, tables 129
and 513 blocks wide: max_model_len 2,048 and 8,192), and what a CUDA runner's launch builds (`CudaLaunchInputs`,
max_model_len 4,096: a graph where the step fits one, else the paged path) after its read ahead (`prepare`, untimed:
it runs while the forward before runs), when a row was reshaped since (its read patched and its step built by one
call of the op library, or read again without it, and built) and when the requests were only fed (the inputs built
ahead, the ids put in); then one call of the op library on a 1-row plan (torch's dispatcher and the call alone). All
on the host (CPU tensors; on CUDA a page-locked copy and the transfers come on top). Median milliseconds of `--repeats` builds; `--cold`: each after
an argmax over a step's logits, as beside the simulated device (a real accelerator samples on itself).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from tandem.core.plan import PlanEdits, ScheduledRequest, StepPlan
from tandem.core.plan_arrays import plan_rows
from tandem.layers.attention import step_inputs
from tandem.runner.cuda_graphs import GraphedSteps, bucket_for
from tandem.runner.simulated import CudaLaunchInputs

BLOCK = 16


def random_plan(rng: random.Random, rows: int, drafts: int, q: int | None = None) -> StepPlan:
    """`rows` requests past their prompts, each feeding its token and up to `drafts` drafts (exactly `q` tokens)."""
    plan = StepPlan(0)
    for i in range(rows):
        n = q if q is not None else 1 + rng.randint(0, drafts)
        start = rng.randint(100, 1500)
        blocks = list(range(i * 100, i * 100 + -(-(start + n) // BLOCK)))
        plan.requests.append(ScheduledRequest(f"r{i}", [rng.randrange(50_000) for _ in range(n)], start, blocks, n - 1))
    return plan


def median_ms(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median ms of `fn()`, `before()` (untimed) ahead of each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def eager_inputs(plan: StepPlan, gathered: bool, paged: bool) -> object:
    """What `ModelRunner._inputs(plan)` builds on the CPU for a model whose decode attention takes the given path."""
    return step_inputs(plan, BLOCK, torch.device("cpu"), gathered_decode=gathered, paged_decode=paged)


def fed(plan: StepPlan) -> None:
    """The scheduler's edits of a plan whose requests were all fed their sampled token since its read."""
    plan.edits = PlanEdits(fed=[(i, 0, r.input_ids[0]) for i, r in enumerate(plan.requests)])


def reshaped(plan: StepPlan) -> None:
    """... and one row of it moved back (a rejected draft): the launch patches its read and builds its inputs (the op
    library's `plan_patch_step`; else it reads the plan again and builds them)."""
    fed(plan)
    plan.edits.reshaped.append(plan.requests[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true",
                    help="an argmax over [rows, 49,152] bf16 logits before each build, as the host's sampling does "
                         "beside a simulated device (it streams the logits through the caches)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    logits = torch.randn(args.rows, 49_152).to(torch.bfloat16)
    flush = (lambda: logits.argmax(-1)) if args.cold else (lambda: None)
    print(f"launch inputs of a {args.rows}-row step, host ms (median of {args.repeats}){', cold' if args.cold else ''}")
    print("| plan | tokens | eager: CPU kernels | eager: torch gathered | eager: paged (CUDA) | graph, 129 blocks | graph, 513 blocks "
          "| CUDA launch, a row reshaped since its read | CUDA launch, fed since (built ahead) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, drafts, q in (("decode", 0, 1), ("verify, 0-4 drafts", 4, None), ("verify, 4 drafts each", 4, 5)):
        plan = random_plan(rng, args.rows, drafts, q)
        cells = [median_ms(lambda g=g, p=p, pl=plan: eager_inputs(pl, g, p), args.repeats, flush)
                 for g, p in ((False, False), (True, False), (False, True))]
        for width in (129, 513):
            if q is None or bucket_for(args.rows, q) is None:
                cells.append(float("nan"))  # uneven rows, or more tokens than a graph takes: eager
                continue
            graphs = GraphedSteps(forward=lambda *_: torch.empty(0), capture=lambda fn: (None, fn()),
                                  device=torch.device("cpu"), block_size=BLOCK, scratch_block=1 << 20, max_blocks=width)
            cells.append(median_ms(lambda gs=graphs, pl=plan: gs.prepare(pl, plan_rows(pl.requests, BLOCK)), args.repeats,
                                   flush))
        for edit in (reshaped, fed):
            cuda = CudaLaunchInputs(BLOCK, 4096, 1 << 20)  # (its read ahead untimed: it runs beside the forward before)
            cells.append(median_ms(lambda c=cuda, pl=plan: c(pl), args.repeats,
                                   before=lambda c=cuda, pl=plan, e=edit: (c.prepare(pl), e(pl), flush())))
        print(f"| {name} | {plan.num_tokens} | " + " | ".join("-" if c != c else f"{c:.2f}" for c in cells) + " |")
    if hasattr(torch.ops.tandem, "step_inputs"):  # what any launch pays for reaching torch's dispatcher at all
        one = [torch.tensor(v) for v in ([5], [1], [1], [1], [3])]
        ms = median_ms(lambda: torch.ops.tandem.step_inputs(*one, BLOCK, 8), args.repeats, flush)
        print(f"one call of the op library on a 1-row plan (step_inputs): {ms:.3f} ms")


if __name__ == "__main__":
    main()
