"""Named and required tool calls over the whole function corpus (>= 100 definitions), through the engine directly
with the server's own rendering (ToolPlan: the demo template knows no tools, so the fallback prompt) and grammar
(the structural tag): every call must parse and validate against its function's schema.

Calls cut by max_tokens cannot be complete; they are counted and reported apart, never hidden, and must stay rare.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.tools.parsers import HermesToolParser
from tandem.tools.plan import ToolPlan
from tests.server.test_server import demo
from tests.tools.corpus import load_corpus, tool, tool_set

MAX_TOKENS = 160
SCHEMAS = {e["function"]["name"]: e["function"]["parameters"] for e in load_corpus()}


@pytest.fixture(scope="module")
def llm() -> Any:
    engine = LLM(None, dtype="float32", max_model_len=2048, max_num_seqs=32, num_kv_blocks=1200, progress=False)
    yield engine
    engine.shutdown()


def _requests(corpus: list[dict[str, Any]], backend: str) -> list[tuple[str, dict[str, Any], ToolPlan]]:
    """(mode, entry, plan) for a named call and a required call (3 tools, no parallel calls) per entry."""
    out = []
    for i, entry in enumerate(corpus):
        name = entry["function"]["name"]
        out.append(("named", entry, ToolPlan.build([tool(entry)], {"type": "function", "function": {"name": name}},
                                                   None, HermesToolParser(), native=False)))
        out.append(("required", entry, ToolPlan.build(tool_set(corpus, i), "required", False, HermesToolParser(), native=False)))
    assert all(p is not None for _, _, p in out)
    return out  # type: ignore[return-value]


def _check(mode: str, entry: dict[str, Any], plan: ToolPlan, text: str, finish: str, stats: dict[str, list[str]],
           error: str | None) -> None:
    calls = plan.parser.parse(text).tool_calls
    if finish == "length":
        stats["length"].append(entry["function"]["name"])
        return
    assert finish == "stop", (mode, finish, text, error)
    assert len(calls) == 1, (mode, text)
    call = calls[0]
    offered = {f.name: f for f in plan.tools}
    assert call.name in offered, (mode, call.name)
    if mode == "named":
        assert call.name == entry["function"]["name"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])  # the function's own schema, as written
    stats["valid"].append(f"{mode}:{call.name}")


@demo
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_named_and_required_calls_validate_over_the_corpus(llm: Any, backend: str) -> None:
    corpus = load_corpus()
    assert len(corpus) >= 100
    tok = llm.llm_engine.tokenizer
    reqs = _requests(corpus, backend)
    prompts, params = [], []
    for _, entry, plan in reqs:
        messages = plan.conversation([{"role": "user", "content": entry["prompt"]}])
        prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True, **plan.template_kwargs()))
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=plan.structured_outputs(backend)))
    outs = []
    for i in range(0, len(prompts), 32):  # 32 in flight, as a server under load: 260 distinct grammars at once
        outs += llm.generate(prompts[i : i + 32], params[i : i + 32], use_tqdm=False)  # would queue compiles past the timeout
    stats: dict[str, list[str]] = {"valid": [], "length": []}
    for (mode, entry, plan), out in zip(reqs, outs):
        c = out.outputs[0]
        _check(mode, entry, plan, c.text, c.finish_reason or "", stats, out.error)
    n = len(reqs)
    print(f"\n{backend}: {len(stats['valid'])}/{n} calls valid, {len(stats['length'])} cut by max_tokens={MAX_TOKENS}: "
          f"{stats['length']}")
    assert len(stats["valid"]) + len(stats["length"]) == n
    assert len(stats["length"]) <= n // 50, stats["length"]  # a 135M model loops in a free string now and then
