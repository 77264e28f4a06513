"""`tandem demo` (what `make demo` runs): a short, visible tour on the built-in demo model, ending with measured tok/s."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from tandem.bench.common import drive, print_table
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams


def _section(title: str) -> None:
    print(f"\n\033[1m== {title} ==\033[0m", flush=True)


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> str:
    """Generate one request, printing text as it is produced."""
    from tandem.cli import stream_to_terminal

    final = stream_to_terminal(engine, f"demo-{time.monotonic_ns()}", prompt, params)
    print()
    return final.outputs[0].text if final is not None else ""


def tour_generation(engine: LLMEngine, rows: list[dict[str, object]], quick: bool) -> None:
    tok = engine.tokenizer
    _section("Chat, streamed token by token (greedy, bf16, paged KV cache)")
    question = "In two sentences, why is the sky blue?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    stream(engine, tok.apply_chat_template([{"role": "user", "content": question}]), SamplingParams(temperature=0.0, max_tokens=64))

    _section("Sampling with a seed (same seed -> same text, whatever else runs)")
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24, n=2)
    engine.add_request("seeded", tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]), p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                for o in out.outputs:
                    print(f"  [{o.index}] {o.text!r}")

    _section("Continuous batching: requests of mixed lengths join and leave every step")
    n = 8 if quick else 16
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in _questions(n)]
    one = drive(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), 1, "batch-1")
    many = drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), n, f"batch-{n}")
    rows.append({"what": "decode, 1 request at a time", **_speed(one)})
    rows.append({"what": f"decode, {n} concurrent requests", **_speed(many)})
    st = engine.get_stats()
    print(f"  {many.num_requests} requests, {many.output_tokens} tokens in {many.wall_s:.1f} s; "
          f"KV cache {st['kv_num_blocks']} blocks, prefix-cache hits {st['prefix_cache_hits']} tokens")


def _speed(r) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {"tok/s": round(r.tok_per_s, 1), "tokens": r.output_tokens, "seconds": round(r.wall_s, 2)}


def _questions(n: int) -> list[str]:
    base = [
        "What is the capital of Japan?", "Give me a tip for learning Python.", "Explain photosynthesis briefly.",
        "What is 17 times 3?", "Name a famous painter.", "How do magnets work?", "Suggest a name for a cat.",
        "What is a prime number?",
    ]
    return [base[i % len(base)] + (" Please be brief." if i % 2 else "") for i in range(n)]


Tour = Callable[[LLMEngine, list[dict[str, object]], bool], None]


def tours() -> list[Tour]:
    """Each capability adds its section here."""
    found: list[Tour] = [tour_generation]
    try:
        from tandem.structured.demo import tour_structured

        found.append(tour_structured)
    except ImportError:
        pass
    try:
        from tandem.spec.demo import tour_speculative

        found.append(tour_speculative)
    except ImportError:
        pass
    return found


def run_demo(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    print("tandem demo: SmolLM2-135M-Instruct (the built-in demo model), CPU", flush=True)
    t0 = time.perf_counter()
    engine = build_engine(None, dtype="bfloat16", max_model_len=2048, max_num_seqs=32, kv_cache_memory=256 * 2**20)
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    rows: list[dict[str, object]] = []
    for tour in tours():
        tour(engine, rows, bool(getattr(args, "quick", False)))
    _section("Measured on this machine")
    print_table(rows)
    return 0
