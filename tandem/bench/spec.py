"""`tandem bench spec`: method x K x batch on the demo model (MT-Bench, HumanEval, a copy-heavy editing task),
speed-up over K = 0 in the same run, acceptance, mean accepted length, device-wait share; HF assisted generation
and prompt-lookup decoding in the same run; a plot of speed-up vs K."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from typing import Any

from tandem.bench.common import RunResult, drive, load_prompts, machine_line, print_table, shared_data_dir
from tandem.engine.engine import LLMEngine
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.params import SamplingParams
from tandem.runner.tensor_thread import on_tensor_thread
from tandem.spec_decode.config import SpeculativeConfig, build_proposer
from tandem.spec_decode.proposer import Proposer


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("spec", help="speculative decoding: method x K x batch, speed-up over K=0")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--methods", default="ngram,suffix,draft_model")
    p.add_argument("--ks", default="0,1,2,4,8,adaptive")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--workloads", default="copy,mt_bench,humaneval")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--peers", default="hf")
    p.add_argument("--plot", default="docs/spec_speedup.png", help="PNG path ('' for none)")
    p.add_argument("--json", type=Path, default=None)
    add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def copy_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """An editing task whose answer mostly copies the prompt: rename the first parameter of a HumanEval solution.

    (Asked instead to "copy the code exactly, renaming the function", the 135M demo model rewrote the bodies, so
    little of its answer was a copy; the rename-a-variable wording, as in `tandem demo`, keeps it copying.)
    """
    with gzip.open(shared_data_dir() / "prompts" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()][: max(n, 1) + 20]
    tok = engine.tokenizer
    out = []
    for i in range(n):
        row = rows[(i * 7) % len(rows)]
        code = row["prompt"] + row["canonical_solution"]  # whole function: signature, docstring, body
        m = re.search(r"def \w+\((\w+)", row["prompt"])
        arg = m.group(1) if m else "x"
        ask = f"Rewrite this function exactly, but rename `{arg}` to `data`. Output only the code.\n\n" + code
        out.append(tok.apply_chat_template([{"role": "user", "content": ask}]))
    return out


def workload_prompts(engine: LLMEngine, name: str, n: int) -> list[list[int]]:
    if name == "copy":
        return copy_prompts(engine, n)
    tok = engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in load_prompts(name, n)]


def default_draft() -> str | None:
    from tandem.paths import tandem_home

    d = tandem_home() / "models" / "smollm2-draft"
    return str(d) if (d / "config.json").is_file() else None


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    batches = [int(b) for b in args.batches.split(",")]
    ks = [k.strip() for k in args.ks.split(",")]
    kw = engine_kwargs(args)
    kw["speculative_config"] = None  # this benchmark swaps speculation per run
    kw["max_num_seqs"] = max(max(batches), kw["max_num_seqs"])
    kw["max_model_len"] = kw["max_model_len"] or 2048
    engine = build_engine(args.model, **kw)
    draft = args.draft_model or default_draft()
    methods = [m for m in args.methods.split(",") if m != "draft_model" or draft]
    if "draft_model" in args.methods and not draft:
        print("draft_model: no draft checkpoint (run `make draft` or pass --draft-model); skipped")
    print(f"machine: {machine_line()}; target {Path(engine.config.model or '').name} {engine.config.dtype}; draft {draft}")
    drive(engine, [[1, 2, 3]], SamplingParams(max_tokens=4), 1, "warmup")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    rows: list[dict[str, Any]] = []
    proposers: dict[str, Proposer] = {}
    for workload in args.workloads.split(","):
        for batch in batches:
            prompts = workload_prompts(engine, workload, max(batch, 2))
            engine.set_speculation(None)
            base = drive(engine, prompts, params, batch, "k0")
            rows.append(_row(workload, batch, "none", "0", base, base, engine))
            for method in methods:
                for k in ks:
                    if k == "0":
                        continue
                    cfg = _config(method, k, draft, args)
                    if method not in proposers or method != "draft_model":
                        # a fresh proposer per run: suffix decoding's global tree must not remember the outputs
                        # of the previous run's identical prompts (the draft worker keeps no such memory)
                        proposers[method] = build_proposer(_config(method, "8", draft, args), engine.vocab_size, engine.tokenizer)
                    engine.set_speculation(cfg, proposers[method])
                    res = drive(engine, prompts, params, batch, f"{method}-{k}")
                    rows.append(_row(workload, batch, method, k, res, base, engine))
                    print_table([rows[-1]])
            engine.set_speculation(None)
    for p in proposers.values():
        p.close()
    print()
    print_table(rows, title="tandem bench spec (speedup = tok/s / tok/s at K=0, same prompts, same run)")
    peer_rows = on_tensor_thread(peers, engine, args, draft)  # tandem's tensor thread: one OpenMP team per process
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "rows": rows, "peers": peer_rows}, indent=2))
    return 0


def _config(method: str, k: str, draft: str | None, args: argparse.Namespace) -> SpeculativeConfig:
    adaptive = k == "adaptive"
    return SpeculativeConfig(method=method, num_speculative_tokens=8 if adaptive else int(k), adaptive=adaptive,
                             model=draft if method == "draft_model" else None, draft_threads=args.draft_threads)


def _row(workload: str, batch: int, method: str, k: str, res: RunResult, base: RunResult, engine: LLMEngine) -> dict[str, Any]:
    st = engine.speculation.stats_dict()
    row: dict[str, Any] = {"workload": workload, "batch": batch, "method": method, "K": k,
                           "tok/s": round(res.tok_per_s, 1), "speedup": round(res.tok_per_s / base.tok_per_s, 2)}
    if st:
        row["accept"] = st["spec_acceptance_rate"]
        row["mean_len"] = st["spec_mean_accepted_length"]
        row["wait_share"] = round(st["spec_draft_wait_s"] / res.wall_s, 3) if res.wall_s else 0.0
    return row


def peers(engine: LLMEngine, args: argparse.Namespace, draft: str | None) -> list[dict[str, Any]]:
    """HF transformers at batch 1 on the copy task: plain, prompt-lookup decoding, assisted generation (same draft)."""
    if "hf" not in args.peers:
        return []
    import time

    import torch
    import transformers

    model_dir = Path(engine.config.model or "")
    dtype = getattr(torch, engine.config.dtype)
    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).eval() if draft else None
    prompts = copy_prompts(engine, 2)
    out: list[dict[str, Any]] = []
    modes: list[tuple[str, dict[str, Any]]] = [("hf plain", {}), ("hf prompt-lookup K=8", {"prompt_lookup_num_tokens": 8})]
    if assistant is not None:
        modes.append(("hf assisted (same draft)", {"assistant_model": assistant}))
    for name, extra in modes:
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            with torch.inference_mode():
                gen = target.generate(ids, max_new_tokens=args.output_len, do_sample=False, **extra)
            n += gen.shape[1] - ids.shape[1]
        out.append({"peer": name, "tok/s": round(n / (time.perf_counter() - t0), 1)})
    print_table(out, title="HF transformers, batch 1, copy task")
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    series: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r["method"] == "none" or r["K"] == "adaptive":
            continue
        series.setdefault((r["workload"], r["method"], r["batch"]), []).append((float(r["K"]), r["speedup"]))
    workloads = sorted({k[0] for k in series})
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(5 * max(1, len(workloads)), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for (wl, method, batch), pts in sorted(series.items()):
            if wl != w:
                continue
            pts = [(0.0, 1.0), *sorted(pts)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{method} b={batch}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(w)
        ax.set_xlabel("K (drafts per step)")
        ax.set_ylabel("speed-up over K=0")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
