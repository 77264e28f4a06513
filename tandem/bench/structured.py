"""`tandem bench structured`: the same requests guided vs unguided (fixed and dynamic lengths, batch 1 and N
concurrent, JSON schemas of growing complexity), with grammar-side figures, and peers in the same run."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tandem.bench.common import (
    RunResult,
    drive,
    load_prompts,
    machine_line,
    percentile,
    print_table,
    shared_data_dir,
)
from tandem.engine.engine import LLMEngine
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.runner.tensor_thread import on_tensor_thread

SCHEMAS: dict[str, dict[str, Any]] = {
    "simple": {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
               "required": ["answer", "confidence"], "additionalProperties": False},
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "author": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                       "required": ["name"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["title", "author", "tags", "rating"],
    },
    "complex": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"enum": ["open", "closed", "pending"]},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
                "required": ["sku", "qty", "price"]}},
            "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["id", "status", "items", "notes"],
    },
}
# fixed length: a string too long to finish within max_tokens, so every request runs to max_tokens as the unguided
# one does (the grammar cannot terminate earlier)
def open_ended(out_len: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": 8 * out_len}}, "required": ["text"]}


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("structured", help="guided vs unguided throughput, mask fill and compile times")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--prompts-per-level", default="6,64")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--workloads", default="fixed,dynamic")
    p.add_argument("--backend", default="xgrammar", choices=["auto", "xgrammar", "llguidance"])
    p.add_argument("--peers", default="hf,llama.cpp")
    p.add_argument("--mask-vocab", default="o200k_base", help="also time mask fills on this tiktoken vocabulary ('' to skip)")
    p.add_argument("--json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def _prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    texts = load_prompts("mixed", n)
    ask = "Answer as JSON. "
    return [tok.apply_chat_template([{"role": "user", "content": ask + t}]) for t in texts]


def _params(schema: dict[str, Any] | None, fixed: bool, out_len: int, backend: str) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, backend=backend) if schema is not None else None
    return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=fixed and schema is None, structured_outputs=so)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.prompts_per_level.split(",")]
    counts = (counts + [counts[-1]] * len(levels))[: len(levels)]
    kw = engine_kwargs(args)
    kw["max_num_seqs"] = max(max(levels), kw["max_num_seqs"])
    kw["max_model_len"] = kw["max_model_len"] or 2048
    engine = build_engine(args.model, **kw)
    print(f"machine: {machine_line()}; mask mode {engine.mask_mode}; backend {args.backend}")
    engine.guidance.warm_up()
    drive(engine, [[1, 2, 3]], SamplingParams(max_tokens=4), 1, "warmup")
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        fixed = workload == "fixed"
        for level, count in zip(levels, counts):
            prompts = _prompts(engine, count)
            before = engine.get_stats()
            base = drive(engine, prompts, _params(None, fixed, args.output_len, args.backend), level, "unguided")
            rows.append(_row(workload, level, "unguided", base, base, before, engine.get_stats()))
            schemas = {"long string": open_ended(args.output_len)} if fixed else SCHEMAS
            for name, schema in schemas.items():
                before = engine.get_stats()
                t0 = time.perf_counter()
                res = drive(engine, prompts, _params(schema, fixed, args.output_len, args.backend), level, "guided")
                res.wall_s = time.perf_counter() - t0
                after = engine.get_stats()
                rows.append(_row(workload, level, f"guided {name}", res, base, before, after))
    print()
    print_table(rows, title="tandem bench structured (ratio = guided tok/s / unguided tok/s, same prompts, same run)")
    gs = engine.get_stats()
    print(f"compile ms p50 {gs.get('grammar_compile_ms_p50', 0):.1f} p99 {gs.get('grammar_compile_ms_p99', 0):.1f}; "
          f"mask fill us/row p50 {gs.get('grammar_mask_fill_us_per_row_p50', 0):.1f} "
          f"p99 {gs.get('grammar_mask_fill_us_per_row_p99', 0):.1f}; cache hits {gs.get('grammar_cache_hits', 0):.0f} "
          f"misses {gs.get('grammar_cache_misses', 0):.0f}; forced fraction {gs.get('guided_forced_fraction', 0):.3f}")
    fills = mask_fill_table(engine, args.mask_vocab)
    peers = peer_rows(engine, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "rows": rows, "mask_fill": fills, "peers": peers, "stats": gs}, f, indent=2)
    return 0


def _row(workload: str, level: int, name: str, res: RunResult, base: RunResult,
         before: dict[str, Any] | None = None, after: dict[str, Any] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": workload, "concurrency": level, "requests": name, "out_tokens": res.output_tokens,
                           "tok/s": round(res.tok_per_s, 1), "ratio": round(res.tok_per_s / base.tok_per_s, 3)}
    if before is not None and after is not None:
        steps = max(1, after["num_steps"] - before["num_steps"])
        tokens = max(1, after["guided_tokens"] - before["guided_tokens"])
        row["exposed_ms/step"] = round(1e3 * (after["grammar_exposed_s"] - before["grammar_exposed_s"]) / steps, 3)
        row["fill_ms/step"] = round(1e3 * (after["grammar_mask_fill_s"] - before["grammar_mask_fill_s"]) / steps, 3)
        row["forward_ms/step"] = round(1e3 * (after["forward_s"] - before["forward_s"]) / steps, 2)
        row["forced"] = round((after["guided_forced_tokens"] - before["guided_forced_tokens"]) / tokens, 3)
    return row


def mask_fill_table(engine: LLMEngine, vocab_name: str) -> list[dict[str, Any]]:
    """Per-row mask fill time for the engine's vocabulary and a large tiktoken one (random-walk through the grammar)."""
    from tandem.structured.backend import GrammarSpec
    from tandem.structured.measure import measure_mask_fill

    out = []
    m = engine.guidance.manager
    for name, schema in SCHEMAS.items():
        spec = GrammarSpec("json", json.dumps(schema), "compact")
        r = measure_mask_fill(m.backend("xgrammar"), spec, steps=200)
        out.append({"vocab": f"engine ({engine.vocab_size})", "schema": name, **{k: round(v, 1) for k, v in r.items()}})
    if vocab_name:
        try:
            from tandem.structured.backend import load_tiktoken
            from tandem.structured.xgrammar_backend import XGrammarBackend

            vocab = load_tiktoken(shared_data_dir() / "tokenizers" / "tiktoken" / f"{vocab_name}.tiktoken")
            backend = XGrammarBackend.from_tiktoken(vocab)  # type: ignore[attr-defined]
            for name, schema in SCHEMAS.items():
                spec = GrammarSpec("json", json.dumps(schema), "compact")
                r = measure_mask_fill(backend, spec, steps=200)
                out.append({"vocab": f"{vocab_name} ({vocab.size})", "schema": name, **{k: round(v, 1) for k, v in r.items()}})
        except (ImportError, AttributeError, OSError, ValueError) as e:
            print(f"mask fill on {vocab_name}: skipped ({e})")
    print_table(out, title="mask fill per row (us), random walk through each schema")
    return out


def peer_rows(engine: LLMEngine, args: argparse.Namespace) -> list[dict[str, Any]]:
    """HF transformers + xgrammar's logits processor, and llama.cpp's JSON-schema grammar, batch 1, same prompts."""
    from tandem.bench import peers

    rows: list[dict[str, Any]] = []
    names = {p.strip() for p in args.peers.split(",") if p.strip()}
    prompts = _prompts(engine, 3)
    schema = SCHEMAS["nested"]
    if "hf" in names:
        for guided in (False, True):
            r = on_tensor_thread(peers.hf_structured, engine, prompts, schema if guided else None, args.output_len)
            rows.append({"peer": "hf-transformers" + (" + xgrammar" if guided else ""), "tok/s": round(r.tok_per_s, 1)})
    if "llama.cpp" in names and peers.llama_cpp_available():
        for guided in (False, True):
            r = peers.llama_cpp_structured(prompts, schema if guided else None, args.output_len)
            rows.append({"peer": "llama.cpp" + (" + json grammar" if guided else ""), "tok/s": round(r.tok_per_s, 1)})
    if rows:
        print_table(rows, title="peers, batch 1, nested schema (same prompts)")
    return rows


__all__ = ["SCHEMAS", "add_parser", "percentile", "run"]
