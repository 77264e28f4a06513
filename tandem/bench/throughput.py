"""`tandem bench throughput`: tandem vs HF transformers (and llama.cpp when installed) on the same prompts, same run.

Workloads: `fixed` (exactly input_len prompt tokens and output_len output tokens, EOS ignored) and `dynamic` (real
chat prompts, real EOS, output capped at output_len). Concurrency levels: tandem keeps that many requests in flight
(continuous batching); HF runs static batches of that size; llama.cpp runs only at concurrency 1.
`--prefill-len N` adds a prefill row: one N-token prompt to its first token (tandem) against HF's forward pass over
the same tokens, prompt tokens per second, best of three distinct prompts (no prefix cache hit).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from tandem.bench.common import RunResult, drive, load_prompts, machine_line, peak_rss_mb, print_table
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.params import SamplingParams


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("throughput", help="output tok/s, TTFT, TPOT vs HF transformers and llama.cpp")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,32", help="comma-separated levels")
    p.add_argument("--prompts-per-level", default="4,64", help="prompts run at each level (comma-separated)")
    p.add_argument("--workloads", default="fixed,dynamic")
    p.add_argument("--peers", default="hf,llama.cpp", help="comma-separated: hf, llama.cpp, or none")
    p.add_argument("--json", type=Path, default=None, help="write all figures here")
    p.add_argument("--prefill-len", type=_non_negative, default=0, help="also time the prefill of one prompt this long")
    p.add_argument("--shape", default=None,
                   help="run random-weight models of this architecture shape instead (smollm2-135m, smollm2-360m, "
                        "smollm2-1.7b, llama3.2-1b, qwen2.5-0.5b, llama3.1-8b; mixtures of experts qwen3-30b-a3b, "
                        "mixtral-8x7b, gpt-oss-20b and their layer-reduced qwen3-30b-a3b-l8, mixtral-8x7b-l4, "
                        "gpt-oss-20b-l4); written once under $TANDEM_HOME")
    p.add_argument("--formats", default="BF16,Q8_0,Q4_1,Q4_K_M",
                   help="with --shape: GGUF file types (BF16, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q6_K, Q4_K_M, Q5_K_M, and "
                        "for gpt-oss MXFP4 (MXFP4 experts, the rest BF16) and MXFP4_MOE (the rest Q8_0)) and/or hf, "
                        "hf-int8 (bf16 safetensors, loaded as is / as int8); llama.cpp runs the same GGUF")
    add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no prefill row), got {value}")
    return value


def fixed_prompts(tok: Any, n: int, input_len: int) -> list[list[int]]:
    """`n` prompts of exactly `input_len` tokens cut from real prompts (repeated when one is too short)."""
    texts = load_prompts("mixed", max(n, 3))
    out = []
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)])
        while len(ids) < input_len:
            ids = ids + tok.encode(" " + texts[(i + len(ids)) % len(texts)])
        out.append(ids[:input_len])
    return out


def dynamic_prompts(tok: Any, n: int) -> list[list[int]]:
    texts = load_prompts("mixed", n)
    if tok.has_chat_template:
        return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tok.encode(t) for t in texts]


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    if args.shape:
        return run_shape_formats(args)
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.prompts_per_level.split(",")]
    counts = (counts + [counts[-1]] * len(levels))[: len(levels)]
    peers = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    kw = engine_kwargs(args)
    kw["max_num_seqs"] = max(max(levels), kw["max_num_seqs"])
    kw["max_model_len"] = kw["max_model_len"] or max(1024, args.input_len + args.output_len + 16)
    engine = build_engine(args.model, **kw)
    tok = engine.tokenizer
    model_dir = Path(engine.config.model or "")
    dtype = getattr(torch, engine.config.dtype)
    threads = args.threads or len(os.sched_getaffinity(0))
    print(f"machine: {machine_line()}; model {model_dir.name} {engine.config.dtype} on {engine.config.device}; "
          f"threads {threads}; KV cache {engine.runner.kv_cache_bytes / 2**20:.0f} MiB ({engine.runner.num_blocks} blocks)")
    drive(engine, [tok.encode("Hello")], SamplingParams(max_tokens=8), 1, "warmup")

    results: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        fixed = workload == "fixed"
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=fixed)
        for level, count in zip(levels, counts):
            prompts = fixed_prompts(tok, count, args.input_len) if fixed else dynamic_prompts(tok, count)
            tres = drive(engine, prompts, params, level, "tandem")
            rows = [(tres, "tandem")]
            if "hf" in peers:
                pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else tok.eos_token_ids[0]
                rows.append((hf_run(model_dir, prompts, args.output_len, level, dtype, fixed, tok.eos_token_ids, pad), "hf"))
            if "llama.cpp" in peers and level == 1:
                lres = llama_cpp_run(prompts, args.output_len, fixed, threads, tok.eos_token_ids)
                if lres is not None:
                    rows.append((lres, "llama.cpp"))
            for r, _ in rows:
                row = {"workload": workload, "concurrency": level, **r.row()}
                row["vs_tandem"] = round(tres.tok_per_s / r.tok_per_s, 2) if r.tok_per_s else None
                results.append(row)
            print_table([{"workload": workload, "concurrency": level, **r.row()} for r, _ in rows])
    if args.prefill_len:
        prefill = prefill_rows(engine, model_dir, tok, args.prefill_len, dtype, "hf" in peers)
        print_table(prefill)
        results.extend(prefill)
    results.append({"name": "peak_rss_mb", "value": round(peak_rss_mb(), 1)})
    print()
    print_table([r for r in results if "workload" in r], title="tandem bench throughput (vs_tandem = tandem tok/s / row tok/s)")
    print(f"peak RSS (tandem + peers, one process): {peak_rss_mb():.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "results": results}, indent=2))
    return 0


def run_shape_formats(args: argparse.Namespace) -> int:
    """`--shape`: every format of a random-weight model, tandem and llama.cpp on the same file (`bench/shaped.py`)."""
    from tandem.bench.shaped import run_shapes
    from tandem.models.demo import find_demo_gguf
    from tandem.models.gguf_loader import gguf_tokenizer_folder
    from tandem.models.shapes import get_shape
    from tandem.tokenizer import Tokenizer

    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.prompts_per_level.split(",")]
    counts = (counts + [counts[-1]] * len(levels))[: len(levels)]
    tok = Tokenizer.from_path(gguf_tokenizer_folder(find_demo_gguf()))  # every shape speaks the demo's tokens
    vocab = get_shape(args.shape).vocab  # a smaller vocabulary (Mixtral's 32,000) is the demo's cut to it: ids past
    # it are folded in (speed does not depend on which tokens; llama.cpp refuses a batch with an id outside it)
    prompts = [[[t % vocab for t in ids] for ids in fixed_prompts(tok, n, args.input_len)] for n in counts]
    rows = run_shapes(args, engine_kwargs(args), levels, prompts)
    print()
    print_table(rows, title=f"tandem bench throughput --shape {args.shape} (vs_tandem = tandem tok/s / row tok/s)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "shape": args.shape, "results": rows}, indent=2))
    return 0


def prefill_rows(engine: Any, model_dir: Path, tok: Any, length: int, dtype: torch.dtype, hf: bool) -> list[dict[str, Any]]:
    """Prompt tokens per second of one `length`-token prefill: tandem's time to first token, HF's forward pass."""
    prompts = fixed_prompts(tok, 4, length)
    prompts = [[p[0] + i] + p[1:] for i, p in enumerate(prompts)]  # distinct from the first token: no cached prefix
    once = SamplingParams(temperature=0.0, max_tokens=1)
    tandem_s = min(min(drive(engine, [p], once, 1, f"prefill-{i}").ttft_s) for i, p in enumerate(prompts[1:]))
    rows = [{"workload": "prefill", "name": "tandem", "prompt_tokens": length, "ms": round(tandem_s * 1e3, 1),
             "prompt_tok/s": round(length / tandem_s, 1)}]
    if hf:
        from tandem.bench.peers import hf_prefill_s
        from tandem.runner.tensor_thread import on_tensor_thread

        hf_s = on_tensor_thread(hf_prefill_s, model_dir, prompts[1:], dtype)
        rows.append({"workload": "prefill", "name": "hf-transformers", "prompt_tokens": length, "ms": round(hf_s * 1e3, 1),
                     "prompt_tok/s": round(length / hf_s, 1)})
    for r in rows:
        r["vs_tandem"] = round(r["ms"] / rows[0]["ms"], 2) if r["ms"] else None  # type: ignore[operator]
    return rows


def hf_run(model_dir: Path, prompts: list[list[int]], out_len: int, level: int, dtype: torch.dtype, fixed: bool,
           eos: tuple[int, ...], pad: int) -> RunResult:
    from tandem.bench.peers import hf_generate
    from tandem.runner.tensor_thread import on_tensor_thread

    # on tandem's tensor thread: a second OpenMP team in this process would slow tandem's later runs (and HF's)
    return on_tensor_thread(hf_generate, model_dir, prompts, out_len, level, dtype, fixed, eos, pad)


def llama_cpp_run(prompts: list[list[int]], out_len: int, fixed: bool, threads: int, eos: tuple[int, ...]) -> RunResult | None:
    """llama.cpp on a bf16 GGUF written from the demo model's weights (only the demo model has a GGUF source here)."""
    from tandem.bench.peers import llama_cpp_available, llama_cpp_generate, write_bf16_gguf
    from tandem.models.demo import find_demo_gguf
    from tandem.paths import tandem_home

    if not llama_cpp_available():
        return None
    dst = tandem_home() / "models" / "SmolLM2-135M-Instruct.bf16.gguf"
    dst.parent.mkdir(parents=True, exist_ok=True)
    gguf = write_bf16_gguf(find_demo_gguf(), dst)
    return llama_cpp_generate(gguf, prompts, out_len, fixed, threads, eos)
