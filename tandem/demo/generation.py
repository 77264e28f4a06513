"""`tandem demo` section: chat streamed token by token, seeded sampling, continuous batching with measured tok/s."""

from __future__ import annotations

from tandem.bench.common import drive
from tandem.demo.common import Rows, chat_prompt, section, speed, stream
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams

QUESTIONS = [
    "What is the capital of Japan?", "Give me a tip for learning Python.", "Explain photosynthesis briefly.",
    "What is 17 times 3?", "Name a famous painter.", "How do magnets work?", "Suggest a name for a cat.",
    "What is a prime number?",
]


def questions(n: int) -> list[str]:
    """`n` short chat questions (the base set repeated, every other one asking for brevity)."""
    return [QUESTIONS[i % len(QUESTIONS)] + (" Please be brief." if i % 2 else "") for i in range(n)]


def tour_generation(engine: LLMEngine, rows: Rows, quick: bool) -> None:
    section("Chat, streamed token by token (greedy, bf16, paged KV cache)")
    question = "In two sentences, why is the sky blue?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    stream(engine, chat_prompt(engine, question), SamplingParams(temperature=0.0, max_tokens=64))

    section("Sampling with a seed (same seed -> same text, whatever else runs)")
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24, n=2)
    engine.add_request("seeded", chat_prompt(engine, "Write a haiku about the sea."), p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                for o in out.outputs:
                    print(f"  [{o.index}] {o.text!r}")

    section("Continuous batching: requests of mixed lengths join and leave every step")
    n = 8 if quick else 16
    prompts = [chat_prompt(engine, q) for q in questions(n)]
    fixed = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    one = drive(engine, prompts[:2], fixed, 1, "batch-1")
    many = drive(engine, prompts, fixed, n, f"batch-{n}")
    rows.append({"what": "decode, 1 request at a time", **speed(one)})
    rows.append({"what": f"decode, {n} concurrent requests", **speed(many)})
    st = engine.get_stats()
    print(f"  {many.num_requests} requests, {many.output_tokens} tokens in {many.wall_s:.1f} s; "
          f"KV cache {st['kv_num_blocks']} blocks, prefix-cache hits {st['prefix_cache_hits']} tokens")
