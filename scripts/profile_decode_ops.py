"""Where a decode step's time goes, by operation, timed inside the engine (on its tensor thread).

Wraps the model's layer operations (`LayerOps`: norms, q / k norms, RoPE + KV write, attention, SiLU), its projections,
a MoE layer's routing (`MoeMlp.pairs`) and weighted sum (`MoeMlp.combine`), the forward and the output projection with
timers, then decodes one request greedily and prints each one's ms a step, calls a step and us a call. The timers
cost ~1 us a call. A dense model's decode steps run as one C++ call (`layers/decode_stack.py`), which no Python timer
sees inside: the script turns that off (`TANDEM_DECODE_STACK=0`) unless `--stack` is given, so its per-operation figures
are the Python loop's. The figures of docs/benchmarks.md's MoE section ("routing and the q / k norms as kernels", "gpt-oss
on the fused layer kernels") came from this. Run alone on the machine.

`--batch N` decodes N requests together (one-token prompts, distinct ids, so that they route to different experts): a
step of N rows, as a server's batch of N concurrent requests decodes.

Usage: python scripts/profile_decode_ops.py MODEL.gguf [--steps 64] [--batch 1] [--dtype float32] [--stack]
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Callable
from typing import Any

from tandem import LLM, SamplingParams
from tandem.bench.common import machine_line
from tandem.layers import linear, moe, ops
from tandem.layers.decode_stack import ENV
from tandem.models import llama

TOTAL_S: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name (a function on a class) by one that adds its wall time to TOTAL_S[label]."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL_S[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    for cls in (ops.TorchOps, ops.CpuKernelOps):
        for name in ("add_rms_norm", "qk_norm", "rope_write_kv", "attention", "silu_mul"):
            timed(cls, name, name)
    for cls in (linear.QuantProjection, linear.Bf16GemmProjection, linear.OneDnnProjection, linear.DenseProjection):
        timed(cls, "__call__", f"projection ({cls.__name__})")
    timed(linear.GroupedProjections, "__call__", "grouped experts")
    timed(moe.MoeMlp, "pairs", "moe routing (pairs)")
    timed(moe.MoeMlp, "combine", "moe weighted sum")
    timed(moe.MoeMlp, "__call__", "moe layer (all)")
    timed(llama.LlamaModel, "forward", "forward")
    timed(llama.LlamaModel, "logits", "logits (output projection)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (rows a step)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stack", action="store_true", help="keep the decode stack (only the forward's total is timed)")
    args = ap.parse_args()
    if not args.stack:
        os.environ[ENV] = "0"

    if args.steps < 1 or args.batch < 1:
        raise SystemExit("--steps and --batch must be >= 1")
    instrument()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=max(args.batch, 8), progress=False)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1128))}], warm, use_tqdm=False)
    TOTAL_S.clear()
    CALLS.clear()
    run = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1000 + 37 * i]} for i in range(args.batch)], run, use_tqdm=False)
    elapsed = time.perf_counter() - t
    llm.shutdown()
    steps = CALLS["forward"]
    print(f"machine: {machine_line()}")
    print(f"{args.model}: {steps} forwards of {args.batch} rows, {elapsed / steps * 1e3:.2f} ms a step end to end")
    for label, total in sorted(TOTAL_S.items(), key=lambda kv: -kv[1]):
        print(f"  {label:34s} {total / steps * 1e3:8.3f} ms/step  {CALLS[label] / steps:6.1f} calls/step  "
              f"{total / CALLS[label] * 1e6:9.1f} us/call")


if __name__ == "__main__":
    main()
