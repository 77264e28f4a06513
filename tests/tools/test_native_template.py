"""Tool calling through a chat template that knows tools (Qwen 2.5's, on a tiny random-weight Qwen2 checkpoint whose
vocabulary has `<tool_call>` as one token): the template renders `tools=` and the tool history, the format is read
off the template, and named / required / auto calls come back valid on both backends, via `LLM.chat(tools=...)`.

Random weights write no sense, so the schemas are bounded (enums, ranges, maxLength) and the auto-mode test pushes
the trigger token with logit_bias: what is checked is the machinery, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.tools import ToolPlan, choose_parser
from tandem.tools.parsers import HermesToolParser
from tests.tools.tiny_model import TOOL_TOKENS

FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"]}}}
LAMP = {"type": "function", "function": {
    "name": "set_lamp", "description": "Switch a lamp.",
    "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 10},
        "room": {"type": "string", "enum": ["kitchen", "hall"]}}, "required": ["on", "room"]}}}
TOOLS = [FORECAST, LAMP]
ASK = [{"role": "user", "content": "Will it rain in Paris this week?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def llm(tool_model_dir: Path) -> Any:
    engine = LLM(str(tool_model_dir), dtype="float32", max_model_len=2048, max_num_seqs=8, num_kv_blocks=256, progress=False)
    yield engine
    engine.shutdown()


def _generate(llm: Any, choice: Any, backend: str, parallel: bool = False, **sampling: Any) -> Any:
    """One request rendered and constrained as the server does it (ToolPlan), on `backend`."""
    tok = llm.get_tokenizer()
    plan = ToolPlan.build(TOOLS, choice, parallel, *choose_parser("auto", tok.hf.chat_template))
    prompt = tok.apply_chat_template(plan.conversation(ASK), **plan.template_kwargs())
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 120, **sampling},
                            structured_outputs=plan.structured_outputs(backend))
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _calls(llm: Any, out: Any) -> list[Any]:
    calls = llm.tool_parser().parse(out.outputs[0].text).tool_calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_the_template_renders_tools_and_the_tool_history(llm: Any) -> None:
    tok = llm.get_tokenizer()
    parser, native = choose_parser("auto", tok.hf.chat_template)
    assert isinstance(parser, HermesToolParser) and native
    plan = ToolPlan.build(TOOLS, "auto", None, parser, native)
    assert plan is not None
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_forecast",
                                                                     "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain on Tuesday"}]
    text = tok.render_chat(plan.conversation(history), True, **plan.template_kwargs())
    assert "# Tools" in text and '"name": "set_lamp"' in text  # the template's own tools section
    assert '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nrain on Tuesday\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.hf.convert_tokens_to_ids(TOOL_TOKENS[0])) == 3  # one token each: two in the tools section, the call


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_named_and_required_calls_validate(llm: Any, backend: str) -> None:
    named = _generate(llm, {"type": "function", "function": {"name": "set_lamp"}}, backend)
    required = _generate(llm, "required", backend)
    several = _generate(llm, "required", backend, parallel=True, temperature=1.0, seed=3)
    assert named.outputs[0].finish_reason == "stop", named.outputs[0].text
    assert [c.name for c in _calls(llm, named)] == ["set_lamp"]
    assert named.outputs[0].text.startswith(TOOL_TOKENS[0])
    assert required.outputs[0].finish_reason == "stop" and len(_calls(llm, required)) == 1
    assert _calls(llm, several), several.outputs[0].text  # parallel calls allowed: each complete one validates


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_auto_call_after_the_trigger_token_validates(llm: Any, backend: str) -> None:
    """The trigger is one token here: the bias makes the model take it, the grammar holds what follows."""
    trigger = llm.get_tokenizer().hf.convert_tokens_to_ids(TOOL_TOKENS[0])
    out = _generate(llm, "auto", backend, logit_bias={trigger: 100.0})
    plain = _generate(llm, "auto", backend, max_tokens=8)
    assert out.outputs[0].token_ids[0] == trigger
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    assert len(_calls(llm, out)) == 1
    assert not _calls(llm, plain)  # without the bias: free text, no call


def test_offline_chat_with_tools(llm: Any) -> None:
    """LLM.chat(tools=...): the template's tools section, and with tool_choice the tool grammar (default backend)."""
    params = SamplingParams(temperature=0.0, max_tokens=120)
    shown = llm.chat(ASK, params.clone(max_tokens=4), tools=TOOLS, use_tqdm=False)[0]
    called = llm.chat(ASK, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, use_tqdm=False)[0]
    plain = llm.chat(ASK, params.clone(max_tokens=4), use_tqdm=False)[0]
    assert len(shown.prompt_token_ids) > len(plain.prompt_token_ids) + 100  # the tools are in the prompt
    assert called.outputs[0].finish_reason == "stop" and len(_calls(llm, called)) == 1
