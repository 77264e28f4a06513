"""`tandem bench simulated`: the CPU side at accelerator scale, on this machine.

The engine runs as it would beside a GPU, but its runner is `SimulatedRunner`: each forward takes a step's time and no
host CPU: `--step-ms` of wall time, or what `--device-model NAME` computes for the step's tokens (a named model on a
named accelerator, runner/device_model.py). Its logits come from
  * `--logits table` (the default): a table of random rows over a real large vocabulary (o200k by default, from
    ../shared/data), turned into a Hugging Face tokenizer once and cached under $TANDEM_HOME. Drafts are almost
    never accepted: it measures what the CPU side costs, never what speculation gains;
  * `--logits replay`: the demo model's own recorded greedy outputs (bench/replay.py, recorded once), in its own
    vocabulary, so every draft is accepted as that model would accept it (guided requests replay outputs recorded
    under their own schemas).
Modes (`--modes`): text, guided (one distinct schema per request), ngram, suffix, guided+suffix, guided+ngram, and
the draft model on this machine's cores (`--drafts`: the demo model's own Q4_1 file by default, `distilled` for
`make draft`'s): draft (tandem's way: scheduled ahead, drafting past the outcome in flight), draft-sequential (the
original design: draft, then verify), draft-groups (alternating groups). The report says how long, per step, the
device would wait for the host (wall time minus the forwards and sampling, device work on a real GPU), also as a
share of the device's step time, and each mode's speed-up over the same run's text mode at that concurrency.
Not a user-facing mode: it sizes the CPU side for a real device.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.bench.common import drive, machine_line, print_table, shared_data_dir
from tandem.bench.replay import GUIDED_WORKLOAD, TEXT_WORKLOADS, Recording, load_or_record
from tandem.bench.schemas import describe, distinct_schemas
from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.cpu_budget import plan_cpu_budget
from tandem.engine.engine import LLMEngine, freeze_startup_heap
from tandem.engine.speculation import make_speculation
from tandem.layers.kernels import load_cpu_kernels
from tandem.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tandem.paths import tandem_home
from tandem.runner.device_model import DEVICE_MODELS, DeviceModel, device_model
from tandem.runner.simulated import CudaLaunchInputs, LogitsSource, ReplayLogits, SimulatedRunner
from tandem.spec_decode.config import SpeculativeConfig, build_proposer
from tandem.structured.backend import TIKTOKEN_PATTERNS, TIKTOKEN_SPECIALS
from tandem.structured.manager import StructuredOutputConfig
from tandem.tokenizer import Tokenizer

MODES = ("text", "guided", "ngram", "suffix", "guided+suffix", "guided+ngram", "draft", "draft-sequential",
         "draft-groups")


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("simulated", help="the CPU side beside a simulated accelerator (large vocabulary, many requests)")
    p.add_argument("--step-ms", type=float, default=20.0, help="wall time of one simulated forward")
    p.add_argument("--device-model", default=None, choices=sorted(DEVICE_MODELS),
                   help="time each forward as this model on this accelerator would take (instead of --step-ms)")
    p.add_argument("--logits", default="table", choices=["table", "replay"],
                   help="random rows over --vocab, or the demo model's recorded outputs replayed (real acceptance)")
    p.add_argument("--workload", default="mixed", choices=TEXT_WORKLOADS,
                   help="--logits replay: the prompts of the text modes (guided modes: one schema each)")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: 2x the concurrency)")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--vocab", default="o200k_base", help="--logits table: a tiktoken vocabulary in ../shared/data")
    p.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"])
    p.add_argument("--modes", default="text,guided,guided+suffix", help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--spec-k", type=int, default=4, help="drafts per step (the most, with adaptive K)")
    p.add_argument("--fixed-k", action="store_true", help="n-gram / suffix: K fixed at --spec-k (no adaptive K)")
    p.add_argument("--drafts", default="q4_1", help="draft models of the draft modes: q4_1 (the demo model's own "
                                                    "file), distilled (make draft), or a path, each optionally "
                                                    "with :N (drafts among the first N ids only: draft_vocab_size); "
                                                    "comma-separated")
    p.add_argument("--draft-threads", type=int, default=None, help="torch threads of the draft worker")
    p.add_argument("--always-mask", action="store_true",
                   help="fill every guided row's mask (no unmasked greedy rows): the comparison for that optimisation")
    p.add_argument("--cumulative-outputs", action="store_true",
                   help="every request reports at every step (as a streaming server's do) instead of once, at its end "
                        "(as LLM.generate's do): the comparison")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap to the cyclic GC (the engine core freezes it): the comparison")
    p.add_argument("--launch-inputs", default="cuda", choices=["cuda", "none"],
                   help="cuda: each launch first builds on the host what a CUDA runner's launch builds (token ids, "
                   "positions, slots, block tables, CUDA graph padding), so the device waits for it as a real one "
                   "does; none: the launch is free (figures before 2026-12-06)")
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
                     rows_by_token: bool = False, unmasked_min_fill_ms: float = 0.1, *,
                     timing: DeviceModel | None = None, logits: LogitsSource | None = None,
                     async_scheduling: bool | None = None, launch_inputs: bool = True) -> LLMEngine:
    """An engine over a `SimulatedRunner` of `tok`'s vocabulary (padded to 64, as real lm_heads are); with
    `launch_inputs` each launch first builds what a CUDA runner's launch builds on the host (`CudaLaunchInputs`)."""
    vocab = -(-len(tok.hf) // 64) * 64
    model = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 4096,
                                 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "max_position_embeddings": 4096,
                                 "eos_token_id": tok.eos_token_ids[0]})
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=4096)
    cache, num_blocks = CacheConfig(), max_num_seqs * 80
    inputs = CudaLaunchInputs(cache.block_size, sched.max_model_len, num_blocks) if launch_inputs else None
    config = EngineConfig(model="simulated", model_config=model, cache=cache, scheduler=sched)
    runner = SimulatedRunner(vocab, num_blocks=num_blocks, step_s=step_s, rows_by_token=rows_by_token,
                             device_model=timing, logits=logits, launch_inputs=inputs)
    runner.logits.reserve(max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0)))
    draft = speculative is not None and speculative.method == "draft_model"
    budget = plan_cpu_budget(device="cuda", draft_on_cpu=draft)  # beside an accelerator: the forward needs no cores
    structured = StructuredOutputConfig(backend=backend, num_threads=max(2, budget.grammar_threads),
                                        unmasked_greedy=unmasked_greedy, unmasked_min_fill_ms=unmasked_min_fill_ms)
    spec = make_speculation(speculative, build_proposer(speculative, vocab, tok) if speculative else None, 4096)
    return LLMEngine(config, runner, tok, speculation=spec, structured_config=structured, cpu_budget=budget,
                     async_scheduling=async_scheduling)


@dataclass(frozen=True)
class Mode:
    """One row's configuration: grammar or not, what drafts, and how the steps are scheduled."""

    name: str
    guided: bool
    speculative: SpeculativeConfig | None
    async_scheduling: bool | None = None  # None: the engine's default beside an accelerator (ahead)


def parse_mode(name: str, args: argparse.Namespace, draft: str | None = None, draft_vocab: int | None = None) -> Mode:
    """`name` (one of MODES) as a configuration; `draft`: the draft model's path for the draft modes, drafting
    among its first `draft_vocab` ids (None: all)."""
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    guided = name.startswith("guided")
    method = name.split("+")[-1]
    if method in ("ngram", "suffix"):
        return Mode(name, guided, SpeculativeConfig(method=method, num_speculative_tokens=args.spec_k,
                                                    adaptive=not args.fixed_k))
    if method.startswith("draft"):
        sequential = method == "draft-sequential"
        spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=args.spec_k, adaptive=False,
                                 lookahead=not sequential, draft_threads=args.draft_threads,
                                 alternate_groups=method == "draft-groups", draft_vocab_size=draft_vocab)
        return Mode(name, guided, spec, async_scheduling=False if sequential else None)
    return Mode(name, guided, None)


def draft_paths(spec: str) -> dict[str, tuple[str, int | None]]:
    """--drafts as {label: (checkpoint path, draft vocabulary or None)}: q4_1 (the demo model's GGUF), distilled
    (make draft's), or a path, each optionally followed by `:N` (its drafts among the first N ids)."""
    from tandem.bench.spec import default_draft
    from tandem.models.demo import find_demo_gguf

    out: dict[str, tuple[str, int | None]] = {}
    for label in [s.strip() for s in spec.split(",") if s.strip()]:
        item, _, rows = label.partition(":")
        if rows and (not rows.isdigit() or int(rows) < 1):
            raise ValueError(f"--drafts {label!r}: after ':' comes the draft vocabulary, a positive integer")
        vocab = int(rows) if rows else None
        if item == "q4_1":
            out[label] = (str(find_demo_gguf()), vocab)
        elif item == "distilled":
            found = default_draft()
            if found is None:
                print("the distilled draft is missing (run `make draft`); its rows are skipped")
                continue
            out[label] = (found, vocab)
        else:
            out[Path(item).name + (f":{rows}" if rows else "")] = (item, vocab)
    return out


def run(args: argparse.Namespace) -> int:
    # the simulated device's sampling runs on the host: one thread, so the CPU time it takes is known (its wall
    # time) and subtracted exactly from the host's demand, and it leaves the other cores to the CPU side
    torch.set_num_threads(1)
    load_cpu_kernels()  # the simulated device samples greedy rows with the fused kernel, as a CPU-side engine does
    tok = _tokenizer(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    drafts = draft_paths(args.drafts) if any(m.startswith("draft") for m in modes) else {}
    rows: list[dict[str, Any]] = []
    for level in [int(x) for x in args.concurrency.split(",")]:
        n = args.requests or 2 * level
        for name in modes:
            labels = drafts if name.startswith("draft") else {"": (None, None)}
            for label, (path, vocab) in labels.items():
                row = _run_mode(tok, parse_mode(name, args, path, vocab), level, n, args)
                if label:
                    row["mode"] = f"{name}[{label}]"
                rows.append(row)
                _relate(rows)
                print_table(rows[-1:])
    timing = args.device_model or f"a {args.step_ms:g} ms step"
    print()
    print_table(rows, title=f"tandem bench simulated: {timing}, {args.logits} logits "
                            f"({machine_line()}); device_wait = host time the device would idle per step")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "device": timing, "logits": args.logits,
                                         "rows": rows}, indent=2))
    return 0


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    if args.logits == "table":
        return tiktoken_tokenizer(args.vocab)
    from tandem.models.demo import demo_model_path

    return Tokenizer.from_path(demo_model_path())  # replay runs in the recorded model's vocabulary


def _relate(rows: list[dict[str, Any]]) -> None:
    """Each row's speed-up over the text row of its concurrency (when the run has one)."""
    base = {r["concurrency"]: r["tok/s"] for r in rows if r["mode"] == "text"}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = round(r["tok/s"] / b, 3) if b else None


def _workload(tok: Tokenizer, mode: Mode, n: int, args: argparse.Namespace) -> tuple[Recording | None, list[list[int]],
                                                                                   list[SamplingParams]]:
    """The requests of one run: (the recording replayed, or None; prompts; their sampling parameters)."""
    kind = RequestOutputKind.CUMULATIVE if args.cumulative_outputs else RequestOutputKind.FINAL_ONLY  # as LLM.generate
    if args.logits == "table":
        schemas = distinct_schemas(n, seed=n // 2)
        prompts = [tok.encode(describe(s)) for s in schemas]
        return None, prompts, [SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=not mode.guided, output_kind=kind,
            structured_outputs=StructuredOutputsParams(json=s, backend=args.backend) if mode.guided else None)
            for s in schemas]
    rec = load_or_record(GUIDED_WORKLOAD if mode.guided else args.workload, n, args.output_len)
    params = [SamplingParams(
        temperature=0.0, max_tokens=max(1, len(out)), output_kind=kind,
        structured_outputs=StructuredOutputsParams(json=s, backend=args.backend) if mode.guided and s else None)
        for out, s in zip(rec.outputs, rec.schemas)]
    return rec, rec.prompts, params


def _run_mode(tok: Tokenizer, mode: Mode, level: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    rec, prompts, params = _workload(tok, mode, n, args)
    logits = ReplayLogits(-(-len(tok.hf) // 64) * 64, tok.eos_token_ids[0]) if rec is not None else None
    timing = device_model(args.device_model) if args.device_model else None
    engine = simulated_engine(tok, args.step_ms / 1e3, level, args.backend, mode.speculative,
                              unmasked_greedy=not args.always_mask, timing=timing, logits=logits,
                              async_scheduling=mode.async_scheduling, launch_inputs=args.launch_inputs == "cuda")
    if isinstance(logits, ReplayLogits) and rec is not None:
        for i in range(len(rec)):
            logits.expect(f"{mode.name}-{i}", rec.sequence(i))
            if i < 2:
                logits.expect(f"warmup-{i}", rec.sequence(i))
    if mode.guided:
        engine.warm_up_grammars()
    if not args.no_gc_freeze:
        freeze_startup_heap()  # as the engine core does: full GC passes skip the tokenizer tables (50-190 ms each)
    drive(engine, prompts[:2], params[:2], 2, "warmup")
    before, (device0, late0) = engine.get_stats(), _device_s(engine)
    if hasattr(engine.runner, "first_launch_at"):
        engine.runner.first_launch_at = None  # the run's first launch is taken next
    t0, cpu0 = time.perf_counter(), time.process_time()
    with GcPauses() as pauses:
        res = drive(engine, prompts, params, level, mode.name)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after, (device, late) = engine.get_stats(), _device_s(engine)
    engine.shutdown()
    first = getattr(engine.runner, "first_launch_at", None)
    start = max(0.0, first - t0) if first is not None else 0.0
    row = _row(mode.name, level, n, res.output_tokens, (wall, cpu, device - device0, late - late0, start), before, after)
    row["gc_ms/step"] = round(1e3 * pauses.seconds / max(1, row["steps"]), 2)
    return row


def _device_s(engine: LLMEngine) -> tuple[float, float]:
    """The simulated forwards' time so far (each as long as its step's time), and how much later than that their
    replayed logits were built (the simulator's own cost: its builder thread waits for the GIL)."""
    return float(getattr(engine.runner, "device_s", 0.0)), float(getattr(engine.runner, "late_s", 0.0))


def _row(mode: str, level: int, n: int, tokens: int, times: tuple[float, float, float, float, float],
         before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's row. tok/s: on the simulated accelerator's clock (its forwards, sampling included as on a real
    one, and the time it waited for the host); wall_tok/s: on this machine's, where sampling runs on the host.
    host_cpu_ms/step: this process's CPU time per step (every thread), sampling excluded (device work on a real
    accelerator; on one thread here, so its CPU time is its wall time): the CPU side's demand; launch_gap_ms/step:
    the part of the wait between sampling and the next launch (the rest: the host's work outlasting a forward, and
    the run's start before its first launch, `run_start_ms`: device_wait_after_start_% leaves it out); cores_for_step: how
    many cores that demand needs to fit in one device step, i.e. the host to size for no waiting. accept: drafts
    accepted / drafted; scheduled_ahead_share: steps scheduled while the previous ran; launched_first_share: steps
    whose next plan was launched before its rows took their outcome (drafts, no redraft paying)."""
    def d(key: str) -> float:
        return float(after.get(key, 0.0)) - float(before.get(key, 0.0))

    wall, cpu, forwards, late, start = times
    steps = max(1.0, d("num_steps"))
    step_s = forwards / steps  # the device's mean step
    # forwards + sampling: device work on a real accelerator (the late rows' sampling overlaps a forward: not
    # added); the simulator's lateness in building replayed logits is its own, not the host's
    wait = max(0.0, wall - forwards - d("sample_s") - late)
    # late rows' sampling ran during a forward: device work, but not on the device's timeline between forwards
    host_cpu = max(0.0, cpu - d("sample_s") - d("late_sample_s")) / steps  # sampling runs on one thread (see `run`)
    drafted = d("spec_num_drafted")
    device_clock = forwards + wait  # the accelerator's timeline: its forwards (sampling on it) and its idle time
    return {
        "mode": mode, "concurrency": level, "requests": n, "tokens": tokens, "steps": int(steps),
        "tok/s": round(tokens / device_clock, 1) if device_clock else None, "speedup": None,
        "wall_tok/s": round(tokens / wall, 1), "step_ms": round(1e3 * wall / steps, 2),
        "device_step_ms": round(1e3 * step_s, 2),
        "device_wait_ms/step": round(1e3 * wait / steps, 2),
        "device_wait_%_of_step": round(100 * wait / steps / step_s, 1) if step_s else None,
        # of it, the run's start (every request admitted, the first plan scheduled): a longer run pays less of it
        "run_start_ms": round(1e3 * start, 1),
        "device_wait_after_start_%": round(100 * max(0.0, wait - start) / steps / step_s, 1) if step_s else None,
        "launch_gap_ms/step": round(1e3 * d("launch_gap_s") / steps, 2),  # of it: sampled -> next launch (host)
        "sim_late_ms/step": round(1e3 * late / steps, 2),
        "accept": round(d("spec_num_accepted") / drafted, 3) if drafted else None,
        "tokens/step": round(tokens / steps, 2),
        "scheduled_ahead_share": round(d("steps_scheduled_ahead") / steps, 3),
        "launched_first_share": round(d("steps_launched_before_settle") / steps, 3),
        "optimistic_misses/step": round(d("spec_optimistic_misses") / steps, 2),
        "draft_ms/step": round(1e3 * (d("draft_s") or d("spec_draft_wait_s")) / steps, 2),  # (sync or redrafts)
        "grammar_exposed_ms/step": round(1e3 * d("grammar_exposed_s") / steps, 2),
        "mask_fill_ms/step": round(1e3 * d("grammar_mask_fill_s") / steps, 2),
        "sample_ms/step": round(1e3 * d("sample_s") / steps, 2),
        "late_sample_ms/step": round(1e3 * d("late_sample_s") / steps, 2),
        "host_cpu_ms/step": round(1e3 * host_cpu, 2),
        "cores_for_step": round(host_cpu / step_s, 2) if step_s else None,
        "slack_fills/step": round(d("guided_slack_fills") / steps, 1),
        "unmasked_rows/step": round(d("guided_unmasked_rows") / steps, 1),
        "rejected/step": round(d("guided_unmasked_rejected") / steps, 2),
        "unmasked_verify/step": round(d("guided_unmasked_verify") / steps, 1),  # requests verifying drafts unmasked
        "verify_rejected/step": round(d("guided_verify_rejected") / steps, 2),  # ... verified again with masks
        "refills/step": round(d("guided_refills") / steps, 2),
        "failed": int(d("grammar_fill_errors")),
    }
