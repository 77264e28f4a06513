"""Bytes each rank hands to the collectives per step under tensor parallelism: measured (`CommMeter`, around every
launch / collect) against the formula (`runner/distributed.py: step_bytes`), on the demo model or MODEL.

    PYTHONPATH=. python scripts/tp_bytes_per_step.py [--model MODEL] [--tp 2] [--dtype bfloat16] [--requests 32]
"""

from __future__ import annotations

import argparse
from typing import Any

from tandem import LLM, SamplingParams
from tandem.core.plan import StepPlan
from tandem.runner.base import ForwardHandle
from tandem.runner.distributed import TensorParallelRunner, step_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tp, max_model_len=512, max_num_seqs=args.requests,
              progress=False)
    runner = llm.llm_engine.runner
    assert isinstance(runner, TensorParallelRunner)
    cfg = llm.llm_engine.config.model_config
    launched: dict[int, StepPlan] = {}
    launch, collect = runner.launch, runner.collect

    def metered_launch(plan: StepPlan) -> ForwardHandle:
        runner.tp.meter.reset()
        handle = launch(plan)
        launched[id(handle)] = plan
        return handle

    def metered_collect(handle: ForwardHandle) -> Any:
        logits = collect(handle)
        plan = launched.pop(id(handle))
        measured = dict(runner.tp.meter.bytes_by_op)
        formula = step_bytes(plan, cfg, runner.dtype, args.tp, runner.block_size)
        print(f"R={len(plan.requests):4d} T={plan.num_tokens:6d} measured={sum(measured.values()):>12,d} "
              f"formula={sum(formula.values()):>12,d} equal={measured == formula} {measured}", flush=True)
        return logits

    runner.launch, runner.collect = metered_launch, metered_collect  # type: ignore[method-assign]
    prompts = [f"Write a short story number {i} about a cat." for i in range(args.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.shutdown()


if __name__ == "__main__":
    main()
