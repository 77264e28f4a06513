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
from tandem.bench.schemas import describe, distinct_schemas
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
    p.add_argument("--distinct-schemas", type=int, default=0, metavar="N",
                   help="instead: N distinct schemas per backend, submitted at once, cold then warm, vs text at equal lengths")
    p.add_argument("--backends", default="auto,llguidance,xgrammar", help="with --distinct-schemas")
    p.add_argument("--input-len", type=int, default=0, metavar="N",
                   help="with --distinct-schemas: each prompt carries ~N tokens of context before its request")
    p.add_argument("--solo", type=int, default=8, metavar="N",
                   help="with --distinct-schemas: the batch-1 row's number of schemas (0: no batch-1 row)")
    p.add_argument("--answer-records", type=int, default=0, metavar="N",
                   help="with --distinct-schemas: each schema asks for a list of at least N of its records (long answers)")
    p.add_argument("--crossover", action="store_true", help="only the backend crossover table (compile vs fill costs)")
    p.add_argument("--think-budget", type=int, default=None, metavar="N",
                   help="a reasoning model's traffic: each prompt opens a think block, every request (guided or not) "
                        "thinks N tokens (the budget forces the end), then answers; the generic parser unless "
                        "--reasoning-parser names one")
    p.add_argument("--json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def _prompts(engine: LLMEngine, n: int, think: bool = False) -> list[list[int]]:
    """Chat prompts; `think`: each opens a think block after the generation prompt (as Qwen3.6's template does)."""
    tok = engine.tokenizer
    texts = load_prompts("mixed", n)
    ask = "Answer as JSON. "
    rendered = [tok.render_chat([{"role": "user", "content": ask + t}]) + ("<think>\n" if think else "") for t in texts]
    return [tok.encode(r, add_special_tokens=False) for r in rendered]


def _params(schema: dict[str, Any] | None, fixed: bool, out_len: int, backend: str,
            think_budget: int | None = None) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, backend=backend) if schema is not None else None
    return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=fixed and schema is None, structured_outputs=so,
                          thinking_token_budget=think_budget)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    if args.distinct_schemas is not None and args.distinct_schemas < 0:
        raise SystemExit(f"--distinct-schemas must be >= 1, got {args.distinct_schemas}")
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.prompts_per_level.split(",")]
    counts = (counts + [counts[-1]] * len(levels))[: len(levels)]
    kw = engine_kwargs(args)
    kw["max_num_seqs"] = max(max(levels), kw["max_num_seqs"])
    kw["max_model_len"] = kw["max_model_len"] or max(2048, args.input_len + args.output_len + 256)
    if args.think_budget is not None:
        kw["reasoning_parser"] = kw.get("reasoning_parser") or "generic"
    engine = build_engine(args.model, **kw)
    print(f"machine: {machine_line()}; mask mode {engine.mask_mode}; backend {args.backend}")
    engine.warm_up_grammars()
    drive(engine, [[1, 2, 3]], SamplingParams(max_tokens=4), 1, "warmup")
    if args.distinct_schemas:
        return run_distinct(engine, args, levels)
    if args.crossover:
        mask_fill_table(engine, args.mask_vocab)
        return 0
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        fixed = workload == "fixed"
        for level, count in zip(levels, counts):
            prompts = _prompts(engine, count, args.think_budget is not None)
            drive(engine, prompts, SamplingParams(max_tokens=1), level, "prefill")  # both runs find the prompts cached
            before = engine.get_stats()
            base = drive(engine, prompts, _params(None, fixed, args.output_len, args.backend, args.think_budget), level,
                         "unguided")
            rows.append(_row(workload, level, "unguided", base, base, before, engine.get_stats()))
            schemas = {"long string": open_ended(args.output_len)} if fixed else SCHEMAS
            for name, schema in schemas.items():
                before = engine.get_stats()
                t0 = time.perf_counter()
                res = drive(engine, prompts, _params(schema, fixed, args.output_len, args.backend, args.think_budget),
                            level, "guided")
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
    """The crossover between the backends: per schema and vocabulary (the engine's, and a large tiktoken one), each
    backend's compile time and per-row mask fill time (a random walk through the grammar), and after how many
    guided tokens xgrammar's up-front compile is paid back by faster fills ("never" when its fills are not faster)."""
    from tandem.structured.llguidance_backend import LLGuidanceBackend
    from tandem.structured.xgrammar_backend import XGrammarBackend

    hf, eos = engine.tokenizer.hf, list(engine.eos_token_ids)
    vocabs: list[tuple[str, dict[str, Any]]] = [  # in-process backends: compile times without a worker's start
        (f"engine ({engine.vocab_size})", {"xgrammar": XGrammarBackend(hf, engine.vocab_size, eos),
                                           "llguidance": LLGuidanceBackend(hf, engine.vocab_size, eos)})]
    if vocab_name:
        try:
            vocabs.append(_tiktoken_backends(vocab_name))
        except (ImportError, AttributeError, OSError, ValueError) as e:
            print(f"mask fill on {vocab_name}: skipped ({e})")
    out = [_crossover_row(label, backends, name, schema) for label, backends in vocabs for name, schema in SCHEMAS.items()]
    print_table(out, title="backend crossover: compile ms, mask fill us per row (mean / p99), tokens until xgrammar pays")
    return out


def _tiktoken_backends(name: str) -> tuple[str, dict[str, Any]]:
    from tandem.structured.backend import load_tiktoken
    from tandem.structured.llguidance_backend import LLGuidanceBackend
    from tandem.structured.xgrammar_backend import XGrammarBackend

    vocab = load_tiktoken(shared_data_dir() / "tokenizers" / "tiktoken" / f"{name}.tiktoken")
    return f"{name} ({vocab.size})", {"xgrammar": XGrammarBackend.from_tiktoken(vocab),
                                      "llguidance": LLGuidanceBackend.from_tiktoken(vocab)}


def _crossover_row(vocab: str, backends: dict[str, Any], name: str, schema: dict[str, Any]) -> dict[str, Any]:
    from tandem.structured.backend import GrammarSpec
    from tandem.structured.measure import measure_mask_fill

    spec = GrammarSpec("json", json.dumps(schema), "compact")
    x, ll = (measure_mask_fill(backends[b], spec, steps=300) for b in ("xgrammar", "llguidance"))
    saved_us = ll["fill_us_mean"] - x["fill_us_mean"]
    pays = f"{1e3 * (x['compile_ms'] - ll['compile_ms']) / saved_us:.0f}" if saved_us > 0 else "never"
    return {"vocab": vocab, "schema": name,
            "xgrammar compile ms": round(x["compile_ms"], 1), "llguidance compile ms": round(ll["compile_ms"], 1),
            "xgrammar fill us": f"{x['fill_us_mean']:.1f} / {x['fill_us_p99']:.0f}",
            "llguidance fill us": f"{ll['fill_us_mean']:.1f} / {ll['fill_us_p99']:.0f}",
            "xgrammar pays after (tokens)": pays}


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


def run_distinct(engine: LLMEngine, args: argparse.Namespace, levels: list[int]) -> int:
    """Per backend: N distinct schemas all submitted at once (cold: every grammar compiles; warm: the same
    schemas again, from the cache), and the same prompts as text at equal lengths (min_tokens = max_tokens = the
    guided output's length); then batch 1 on a few more distinct schemas."""
    n = args.distinct_schemas
    rows: list[dict[str, Any]] = []
    width = max(levels)
    for backend in args.backends.split(","):  # the process's first guided batches (first-use paths), not in any row
        warm = [SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(json=s, backend=backend))
                for s in distinct_schemas(width, seed=424242)]
        drive(engine, [[1, 2, 3]] * width, warm, width, f"warmup-{backend}")
    for b, backend in enumerate(args.backends.split(",")):
        schemas = distinct_schemas(n, seed=7 + 1000 * b)  # new schemas per backend: its first run is cold
        for phase in ("cold", "warm"):
            rows.append(_distinct_row(engine, schemas, backend, phase, max(levels), args))
        if args.solo:
            solo = distinct_schemas(args.solo, seed=99 + 1000 * b)
            rows.append(_distinct_row(engine, solo, backend, "batch 1 (cold)", 1, args))
        print_table(rows[-3:])
    print()
    print_table(rows, title=f"tandem bench structured --distinct-schemas {n} (ratio = guided / text tok/s, equal lengths)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "distinct": rows, "stats": engine.get_stats()}, f, indent=2)
    return 0


def _long_form(schema: dict[str, Any], records: int) -> dict[str, Any]:
    """`schema` as a list of at least `records` of its records (an answer that runs long, the grammar throughout)."""
    if records <= 0:
        return schema
    return {"type": "object", "title": schema.get("title", "records"), "required": ["records"],
            "properties": {"records": {"type": "array", "items": schema, "minItems": records}}}


def _context(engine: LLMEngine, n_tokens: int, seed: int) -> str:
    """About `n_tokens` of real prompt text (MT-Bench, HumanEval and GSM8K, rotated by `seed`) to put before a request."""
    if n_tokens <= 0:
        return ""
    texts = load_prompts("mixed", 240)
    out: list[str] = []
    used = 0
    for i in range(len(texts)):
        text = texts[(seed * 7 + i) % len(texts)]
        used += len(engine.tokenizer.encode(text, add_special_tokens=False))
        out.append(text)
        if used >= n_tokens:
            break
    return "Context:\n" + "\n\n".join(out) + "\n\nTask: "


def _distinct_row(
    engine: LLMEngine, schemas: list[dict[str, Any]], backend: str, phase: str, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    tok, out_len = engine.tokenizer, args.output_len
    many = f" Give at least {args.answer_records} of them as a list under \"records\"." if args.answer_records else ""
    prompts = [tok.apply_chat_template([{"role": "user", "content": _context(engine, args.input_len, i) + describe(s) + many}])
               for i, s in enumerate(schemas)]
    schemas = [_long_form(s, args.answer_records) for s in schemas]
    guided = [SamplingParams(temperature=0.0, max_tokens=out_len,
                             structured_outputs=StructuredOutputsParams(json=s, backend=backend)) for s in schemas]
    # the prompts' prefixes cached first (untimed), so neither run below pays prefills the other skips
    drive(engine, prompts, SamplingParams(max_tokens=1), concurrency, f"p-{backend}-{phase}")
    manager = engine.guidance.manager
    before = {b: len(manager.compile_durations_s(b)) for b in ("llguidance", "xgrammar")}
    served0 = engine.get_stats()
    outs: dict[int, Any] = {}
    res = drive(engine, prompts, guided, concurrency, f"g-{backend}-{phase}",
                on_output=lambda o: outs.__setitem__(int(o.request_id.rsplit("-", 1)[1]), o))
    mid = engine.get_stats()
    lengths = {i: len(o.outputs[0].token_ids) for i, o in outs.items() if o.outputs[0].finish_reason != "error"}
    failed = [o.error for o in outs.values() if o.outputs[0].finish_reason == "error"] + res.refused
    text = [SamplingParams(temperature=0.0, max_tokens=lengths[i], min_tokens=lengths[i], ignore_eos=True) for i in sorted(lengths)]
    base = drive(engine, [prompts[i] for i in sorted(lengths)], text, concurrency, f"t-{backend}-{phase}")
    guided_tps = sum(lengths.values()) / res.wall_s if res.wall_s else 0.0
    served1 = engine.get_stats()
    row: dict[str, Any] = {"backend": backend, "phase": phase, "concurrency": concurrency, "requests": len(schemas),
                           "failed": len(failed), "guided tok/s": round(guided_tps, 1), "text tok/s": round(base.tok_per_s, 1),
                           "ratio": round(guided_tps / base.tok_per_s, 3) if base.tok_per_s else 0.0}
    for b in ("llguidance", "xgrammar"):
        new = manager.compile_durations_s(b)[before[b]:]
        row[f"served {b}"] = int(served1.get(f"grammar_served_{b}", 0) - served0.get(f"grammar_served_{b}", 0))
        if new:
            row[f"compile ms {b} p50/p99"] = f"{1e3 * percentile(new, 50):.1f}/{1e3 * percentile(new, 99):.1f}"
    # the guided run's steps: host time the forward waited for grammar work, mask fills, the forward itself
    steps = max(1, int(mid["num_steps"] - served0["num_steps"]))
    for key, name in (("grammar_exposed_s", "exposed ms/step"), ("grammar_mask_fill_s", "fill ms/step"),
                      ("forward_s", "forward ms/step"), ("sample_s", "sample ms/step")):
        row[name] = round(1e3 * (mid.get(key, 0) - served0.get(key, 0)) / steps, 2)
    # guided rows sampled without a mask fill (unmasked greedy rows), argmaxes the grammar rejected, masks refilled
    for key, name in (("guided_tokens", "guided tokens"), ("guided_unmasked_rows", "unmasked rows"),
                      ("guided_unmasked_rejected", "rejected"), ("guided_refills", "refilled")):
        row[name] = int(served1.get(key, 0) - served0.get(key, 0))
    if failed:
        row["first failure"] = failed[0][:80]
    return row


__all__ = ["SCHEMAS", "add_parser", "percentile", "run"]
