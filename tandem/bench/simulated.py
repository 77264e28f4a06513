"""`tandem bench simulated`: the CPU side at accelerator scale, on this machine.

The engine runs as it would beside a GPU, but its runner is `SimulatedRunner`: each forward takes `--step-ms` of
wall time and no host CPU, its logits come from a table. The vocabulary is a real large one (o200k by default,
from ../shared/data), turned into a Hugging Face tokenizer once and cached under $TANDEM_HOME. With 256 guided
requests over distinct schemas (and optionally suffix drafting) the report says how long, per step, the device
would wait for the host: wall time per step minus the forward and minus sampling (device work on a real GPU), also
as a share of the device's step time.
Not a user-facing mode: it sizes the CPU side for a real device.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench.common import drive, machine_line, print_table, shared_data_dir
from tandem.bench.schemas import describe, distinct_schemas
from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.cpu_budget import plan_cpu_budget
from tandem.engine.engine import LLMEngine, freeze_startup_heap
from tandem.engine.speculation import make_speculation
from tandem.layers.kernels import load_cpu_kernels
from tandem.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tandem.paths import tandem_home
from tandem.runner.simulated import SimulatedRunner
from tandem.spec_decode.config import SpeculativeConfig, build_proposer
from tandem.structured.backend import TIKTOKEN_PATTERNS, TIKTOKEN_SPECIALS
from tandem.structured.manager import StructuredOutputConfig
from tandem.tokenizer import Tokenizer


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("simulated", help="the CPU side beside a simulated accelerator (large vocabulary, many requests)")
    p.add_argument("--step-ms", type=float, default=20.0, help="wall time of one simulated forward")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: 2x the concurrency)")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--vocab", default="o200k_base", help="a tiktoken vocabulary in ../shared/data/tokenizers/tiktoken")
    p.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"])
    p.add_argument("--modes", default="text,guided,guided+suffix", help="comma-separated: text, guided, guided+suffix")
    p.add_argument("--always-mask", action="store_true",
                   help="fill every guided row's mask (no unmasked greedy rows): the comparison for that optimisation")
    p.add_argument("--cumulative-outputs", action="store_true",
                   help="every request reports at every step (as a streaming server's do) instead of once, at its end "
                        "(as LLM.generate's do): the comparison")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap to the cyclic GC (the engine core freezes it): the comparison")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)


class GcPauses:
    """Wall time the cyclic garbage collector stops every Python thread for, summed while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def tiktoken_tokenizer(name: str) -> Tokenizer:
    """A Hugging Face tokenizer over a tiktoken vocabulary (converted once, cached under $TANDEM_HOME)."""
    from transformers import PreTrainedTokenizerFast

    cached = tandem_home() / "tokenizers" / name
    if not (cached / "tokenizer.json").is_file():
        from transformers.convert_slow_tokenizer import TikTokenConverter

        source = shared_data_dir() / "tokenizers" / "tiktoken" / f"{name}.tiktoken"
        converter = TikTokenConverter(vocab_file=str(source), pattern=TIKTOKEN_PATTERNS[name],
                                      extra_special_tokens=list(TIKTOKEN_SPECIALS[name]))
        fast = PreTrainedTokenizerFast(tokenizer_object=converter.converted(), eos_token="<|endoftext|>")
        fast.save_pretrained(cached)
    return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True))


def simulated_engine(tok: Tokenizer, step_s: float, max_num_seqs: int, backend: str,
                     speculative: SpeculativeConfig | None, unmasked_greedy: bool = True,
                     rows_by_token: bool = False, unmasked_min_fill_ms: float = 0.1) -> LLMEngine:
    vocab = -(-len(tok.hf) // 64) * 64  # a padded lm_head, as real models have
    model = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 4096,
                                 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "max_position_embeddings": 4096,
                                 "eos_token_id": tok.eos_token_ids[0]})
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=2048)
    config = EngineConfig(model="simulated", model_config=model, cache=CacheConfig(), scheduler=sched)
    runner = SimulatedRunner(vocab, num_blocks=max_num_seqs * 40, step_s=step_s, rows_by_token=rows_by_token)
    budget = plan_cpu_budget(device="cuda")  # the host beside an accelerator: the forward needs no cores
    structured = StructuredOutputConfig(backend=backend, num_threads=max(2, budget.grammar_threads),
                                        unmasked_greedy=unmasked_greedy, unmasked_min_fill_ms=unmasked_min_fill_ms)
    spec = make_speculation(speculative, build_proposer(speculative, vocab, tok) if speculative else None, 2048)
    return LLMEngine(config, runner, tok, speculation=spec, structured_config=structured, cpu_budget=budget)


def run(args: argparse.Namespace) -> int:
    # the simulated device's sampling runs on the host: one thread, so the CPU time it takes is known (its wall
    # time) and subtracted exactly from the host's demand, and it leaves the other cores to the CPU side
    torch.set_num_threads(1)
    load_cpu_kernels()  # the simulated device samples greedy rows with the fused kernel, as a CPU-side engine does
    tok = tiktoken_tokenizer(args.vocab)
    rows: list[dict[str, Any]] = []
    for level in [int(x) for x in args.concurrency.split(",")]:
        n = args.requests or 2 * level
        for mode in args.modes.split(","):
            rows.append(_run_mode(tok, mode, level, n, args))
            print_table(rows[-1:])
    print()
    print_table(rows, title=f"tandem bench simulated: a {args.step_ms:g} ms device step, {args.vocab} "
                            f"({machine_line()}); device_wait = host time the device would idle per step")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "rows": rows}, indent=2))
    return 0


def _run_mode(tok: Tokenizer, mode: str, level: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, adaptive=False) if "suffix" in mode else None
    engine = simulated_engine(tok, args.step_ms / 1e3, level, args.backend, spec, unmasked_greedy=not args.always_mask)
    schemas = distinct_schemas(n, seed=level)
    prompts = [tok.encode(describe(s)) for s in schemas]
    guided = mode.startswith("guided")
    kind = RequestOutputKind.CUMULATIVE if args.cumulative_outputs else RequestOutputKind.FINAL_ONLY  # as LLM.generate
    params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=not guided, output_kind=kind,
                             structured_outputs=StructuredOutputsParams(json=s, backend=args.backend) if guided else None)
              for s in schemas]
    if guided:
        engine.warm_up_grammars()
    if not args.no_gc_freeze:
        freeze_startup_heap()  # as the engine core does: full GC passes skip the tokenizer tables (50-190 ms each)
    drive(engine, prompts[:2], params[:2], 2, "warmup")
    before = engine.get_stats()
    t0, cpu0 = time.perf_counter(), time.process_time()
    with GcPauses() as pauses:
        res = drive(engine, prompts, params, level, mode)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = engine.get_stats()
    engine.shutdown()
    row = _row(mode, level, n, res.output_tokens, (wall, cpu), before, after, args.step_ms / 1e3)
    row["gc_ms/step"] = round(1e3 * pauses.seconds / max(1, row["steps"]), 2)
    return row


def _row(mode: str, level: int, n: int, tokens: int, times: tuple[float, float], before: dict[str, Any],
         after: dict[str, Any], step_s: float) -> dict[str, Any]:
    """One run's row. host_cpu_ms/step: this process's CPU time per step (every thread), sampling excluded (device
    work on a real accelerator; on one thread here, so its CPU time is its wall time): the CPU side's demand; cores_for_step: how many cores that demand needs to fit in
    one device step, i.e. the host to size for no waiting."""
    def d(key: str) -> float:
        return float(after.get(key, 0.0)) - float(before.get(key, 0.0))

    wall, cpu = times
    steps = max(1.0, d("num_steps"))
    # forwards + sampling: device work on a real accelerator (the late rows' sampling overlaps a forward: not added)
    device = steps * step_s + d("sample_s")
    wait = max(0.0, wall - device)
    # late rows' sampling ran during a forward: device work, but not on the device's timeline between forwards
    host_cpu = max(0.0, cpu - d("sample_s") - d("late_sample_s")) / steps  # sampling runs on one thread (see `run`)
    return {
        "mode": mode, "concurrency": level, "requests": n, "tokens": tokens, "steps": int(steps),
        "tok/s": round(tokens / wall, 1), "step_ms": round(1e3 * wall / steps, 2),
        "device_wait_ms/step": round(1e3 * wait / steps, 2),
        "device_wait_%_of_step": round(100 * wait / steps / step_s, 1),  # of the device's forward time
        "draft_ms/step": round(1e3 * d("draft_s") / steps, 2),
        "grammar_exposed_ms/step": round(1e3 * d("grammar_exposed_s") / steps, 2),
        "mask_fill_ms/step": round(1e3 * d("grammar_mask_fill_s") / steps, 2),
        "sample_ms/step": round(1e3 * d("sample_s") / steps, 2),
        "late_sample_ms/step": round(1e3 * d("late_sample_s") / steps, 2),
        "host_cpu_ms/step": round(1e3 * host_cpu, 2),
        "cores_for_step": round(host_cpu / step_s, 2),
        "slack_fills/step": round(d("guided_slack_fills") / steps, 1),
        "unmasked_rows/step": round(d("guided_unmasked_rows") / steps, 1),
        "rejected/step": round(d("guided_unmasked_rejected") / steps, 2),
        "refills/step": round(d("guided_refills") / steps, 2),
        "failed": int(d("grammar_fill_errors")),
    }
