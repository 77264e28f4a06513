"""`tandem demo` section: a reasoning request with a JSON schema. The demo model does not think, so the generic
parser and a thinking budget stand in for a reasoning model: the prompt opens `<think>`, the model writes freely
for the budget, the end marker is forced, and only then does the grammar hold the answer to the schema."""

from __future__ import annotations

import json

import jsonschema

from tandem.bench.common import drive
from tandem.demo.common import Rows, section, speed
from tandem.demo.structured import PERSON, TEXTS
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.request import RequestOutput

BUDGET = 24


def tour_reasoning(engine: LLMEngine, rows: Rows, quick: bool) -> None:
    section("Reasoning: the thinking kept apart, the schema applied only after it (generic parser, budget "
            f"{BUDGET} tokens)")
    engine.set_reasoning("generic")
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(tok.render_chat([{"role": "user", "content": f"Extract the person as JSON. {t}"}])
                              + "<think>\n", add_special_tokens=False) for t in TEXTS]
        params = SamplingParams(temperature=0.0, max_tokens=120, thinking_token_budget=BUDGET,
                                structured_outputs=StructuredOutputsParams(json=PERSON))
        outs: list[RequestOutput] = []
        res = drive(engine, prompts, params, len(prompts), "reasoning", on_output=outs.append)
        for out in outs:
            c = out.outputs[0]
            jsonschema.validate(json.loads(c.content or ""), PERSON)
            thought = (c.reasoning or "").strip().replace("\n", " ")
            print(f"  thinking ({c.num_reasoning_tokens} tokens): {thought[:60]}{'...' if len(thought) > 60 else ''}")
            print(f"  answer (valid): {c.content}")
        rows.append({"what": f"thinking {BUDGET} tokens, then JSON schema, {len(prompts)} concurrent", **speed(res)})
    finally:
        engine.set_reasoning(None)
