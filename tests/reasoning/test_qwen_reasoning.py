"""Reasoning on the real Qwen3.6, Qwen3 and DeepSeek-R1-distill tokenizers and templates (tiny random-weight models,
tests/reasoning/qwen_models.py) through `LLM.chat`: the starting state from each template's prompt, the single-token
end marker forced by the budget, the answer under its schema, thinking off by `chat_template_kwargs`, Qwen3's
`<tool_call>` ending the thinking, and the tool grammar applied only to the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tests.reasoning import qwen_models as qm

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "n": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                                                            "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Which city? Answer as JSON."}]


def make_llm(folder: Path, **kw: Any) -> LLM:
    return LLM(str(folder), dtype="float32", progress=False, max_model_len=1024, kv_cache_memory=64 * 2**20,
               reasoning_parser="qwen3", **kw)


@pytest.fixture(scope="module")
def qwen36() -> Iterator[LLM]:
    llm = make_llm(qm.qwen3_6_model())
    yield llm
    llm.shutdown()


def guided(budget: int | None, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=0, thinking_token_budget=budget,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def test_qwen36_thinks_then_answers_under_the_schema(qwen36: LLM) -> None:
    c = qwen36.chat(ASK, guided(8), use_tqdm=False)[0].outputs[0]
    assert c.token_ids[8] == qm.QWEN36_END_THINK and qm.QWEN36_END_THINK not in c.token_ids[:8]
    assert c.num_reasoning_tokens == 9 and c.reasoning is not None and "</think>" not in c.reasoning
    assert c.text == c.reasoning + "</think>" + c.content
    jsonschema.validate(json.loads(c.content or ""), SCHEMA)


def test_qwen36_thinking_off_answers_from_the_first_token(qwen36: LLM) -> None:
    c = qwen36.chat(ASK, guided(8), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert c.reasoning is None and c.num_reasoning_tokens == 0 and c.content == c.text
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_qwen36_budget_with_speculation_and_n(qwen36: LLM) -> None:
    want = qwen36.chat(ASK, guided(6), use_tqdm=False)[0].outputs[0]
    spec = make_llm(qm.qwen3_6_model(), speculative_config={"method": "suffix", "num_speculative_tokens": 4},
                    async_scheduling=True)
    try:
        got = spec.chat(ASK, guided(6), use_tqdm=False)[0].outputs[0]
        sampled = spec.chat(ASK, SamplingParams(n=3, max_tokens=64, temperature=1.0, seed=5, thinking_token_budget=5,
                                                structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                            use_tqdm=False)[0]
    finally:
        spec.shutdown()
    assert got.token_ids == want.token_ids and got.content == want.content
    for c in sampled.outputs:
        assert qm.QWEN36_END_THINK in c.token_ids and c.reasoning is not None
        jsonschema.validate(json.loads(c.content or ""), SCHEMA)


def test_qwen36_required_tool_call_after_the_thinking(qwen36: LLM) -> None:
    out = qwen36.chat(ASK, SamplingParams(max_tokens=64, temperature=0, thinking_token_budget=4), use_tqdm=False,
                      tools=[WEATHER], tool_choice="required")[0].outputs[0]
    assert out.token_ids[4] == qm.QWEN36_END_THINK and out.content is not None
    parsed = qwen36.tool_parser().parse(out.content)
    assert parsed.tool_calls and parsed.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), WEATHER["function"]["parameters"])


def test_qwen3_tool_call_while_thinking_ends_it() -> None:
    """Qwen3 writes `<tool_call>` without closing its block: that token ends the thinking and starts the answer,
    whose call the tool grammar (auto mode: its trigger) then holds to the schema."""
    llm = make_llm(qm.qwen3_model())
    try:
        params = SamplingParams(max_tokens=48, temperature=0, logit_bias={qm.QWEN3_TOOL_CALL: 30.0})
        c = llm.chat(ASK, params, use_tqdm=False, tools=[WEATHER], tool_choice="auto",
                     parallel_tool_calls=False)[0].outputs[0]
    finally:
        llm.shutdown()
    at = c.token_ids.index(qm.QWEN3_TOOL_CALL)
    assert qm.QWEN3_END_THINK not in c.token_ids[:at]
    assert c.num_reasoning_tokens == at and c.content is not None and c.content.startswith("<tool_call>")
    parsed = llm.tool_parser().parse(c.content)
    assert parsed.tool_calls and parsed.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), WEATHER["function"]["parameters"])


def test_r1_distill_prompt_opens_the_block() -> None:
    llm = LLM(str(qm.r1_distill_model()), dtype="float32", progress=False, max_model_len=1024,
              kv_cache_memory=64 * 2**20, reasoning_parser="deepseek_r1")
    try:
        c = llm.chat(ASK, guided(5), use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert c.num_reasoning_tokens == 6 and c.reasoning is not None
    jsonschema.validate(json.loads(c.content or ""), SCHEMA)
