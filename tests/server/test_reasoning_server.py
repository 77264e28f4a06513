"""Reasoning models over HTTP (`tandem serve --reasoning-parser qwen3`): the thinking apart from the answer in chat
completions (messages, stream deltas, usage), in /v1/responses (reasoning items and their events), the request
controls (chat_template_kwargs, reasoning_effort, include_reasoning, thinking_token_budget and the server's
defaults), tool calls and JSON answers read from the answer alone, thinking in the history; driven by the openai SDK,
pydantic-ai and the Agents SDK. A server without the parser shows none of it.

The model is tests/reasoning/qwen_models.py's tiny random-weight Qwen3 with the real Qwen3.6 tokenizer and its
generation prompt (it opens `<think>\\n`). Random weights never close the thinking by themselves, so a budget
(`thinking_token_budget`) forces the end marker; `NO_MARKERS` keeps the model from writing a marker itself, so the
thinking ends where the budget says and the answer never holds one. The first part needs no server.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Literal

import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tandem.server.api import _ChatFormat, _Choice, _ResponsesFormat
from tandem.server.engine_client import CompletionDelta, RequestDelta
from tandem.server.protocol import APIError, ChatCompletionRequest, CompletionTokensDetails, UsageInfo
from tandem.server.reasoning import Thought, keep_history_reasoning, template_kwargs
from tandem.server.responses import ResponsesRequest
from tandem.tokenizer import Tokenizer
from tandem.tools.parsers import HermesToolParser
from tests.reasoning.qwen_models import QWEN36_END_THINK, QWEN36_NAME, QWEN36_THINK, qwen3_6_model
from tests.server.launch import running_server

MODEL = QWEN36_NAME
DEFAULT_BUDGET = 6  # the server's --thinking-token-budget
NO_MARKERS = {str(QWEN36_THINK): -100, str(QWEN36_END_THINK): -100}
ASK = [{"role": "user", "content": "Which city is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}


class City(BaseModel):
    city: Literal["Paris", "Rome"]
    n: int = Field(ge=0, le=9)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


# ============================================================================================ no server needed
def test_template_kwargs_layers_and_thinking_switches() -> None:
    assert template_kwargs(None, None, None) == {}
    assert template_kwargs(None, {"enable_thinking": False}, None) == {"enable_thinking": False, "thinking": False}
    assert template_kwargs(None, {"thinking": True}, None) == {"enable_thinking": True, "thinking": True}
    both = template_kwargs(None, {"thinking": True, "enable_thinking": False}, None)
    assert both == {"thinking": True, "enable_thinking": False}  # both given: each as given
    assert template_kwargs(None, None, "none") == {"reasoning_effort": "none", "enable_thinking": False, "thinking": False}
    assert template_kwargs(None, None, "high") == {"reasoning_effort": "high"}
    # the request's own kwargs win over reasoning_effort, which wins over the server's defaults
    assert template_kwargs({"enable_thinking": False, "x": 1}, {"enable_thinking": True}, "none") == {
        "enable_thinking": True, "thinking": True, "reasoning_effort": "none", "x": 1}
    assert template_kwargs({"thinking": False, "x": 1}, {"x": 2}, None) == {"thinking": False, "enable_thinking": False, "x": 2}
    with pytest.raises(APIError, match="add_generation_prompt") as e:
        template_kwargs(None, {"add_generation_prompt": False}, None)
    assert e.value.param == "chat_template_kwargs"


def test_thought_answer_is_none_only_when_the_thinking_never_ended() -> None:
    """The engine says when the answer began (`CompletionDelta.answering`): an empty answer after an ended thinking
    is "", a thinking that never ended is null."""
    t = Thought()
    t.add(CompletionDelta(0, "abc", [1, 2, 3], None, None, None, "abc", "", 3, False))
    assert t.answer() is None
    t.add(CompletionDelta(0, "</think>", [4], None, "length", None, "", "", 4, True))
    assert t.answer() == "" and t.reasoning == "abc" and t.num_tokens == 4
    never = Thought()
    never.add(CompletionDelta(0, "hello", [5, 6], None, "stop", None, "", "hello", 0, True))
    assert never.answer() == "hello"


def test_history_reasoning_survives_the_tool_conversions() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning": "r1", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "a", "reasoning_content": "r2", "reasoning": "ignored"},
        {"role": "user", "content": "u", "reasoning": "not an assistant's"},
    ]})
    messages = body.conversation()
    assert [(m.get("reasoning"), m.get("reasoning_content")) for m in messages] == [
        (None, None), ("r1", "r1"), (None, None), ("r2", "r2"), (None, None)]
    from tandem.tools.plan import hf_messages

    converted = keep_history_reasoning(hf_messages(messages), messages)  # hf_messages rebuilds every message
    assert [m.get("reasoning_content") for m in converted] == [None, "r1", None, "r2", None]
    assert converted[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}


def test_responses_reasoning_items_become_the_next_assistant_turn() -> None:
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "sum"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "reasoning", "id": "rs_3", "summary": []},
        {"type": "message", "role": "user", "content": "again"},
    ]
    req = ResponsesRequest(input=items, reasoning={"effort": "none"})
    msgs = req.messages()
    assert [(m["role"], m.get("reasoning_content")) for m in msgs] == [
        ("user", None), ("assistant", "think"), ("tool", None), ("assistant", "sum"), ("user", None)]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    chat = req.chat_request()
    assert chat.reasoning_effort == "none" and chat.messages[1].reasoning_content == "think"
    with pytest.raises(APIError, match="reasoning.effort"):
        ResponsesRequest(input="q", reasoning={"effort": "extreme"}).chat_request()


def _fake_state(parser: str | None) -> Any:
    return SimpleNamespace(model_name=MODEL, reasoning_parser=parser, config=SimpleNamespace(reasoning_parser=parser))


def _delta(reasoning: str, content: str, finish: str | None = None, tokens: int = 1, thinking: int = 0,
           answering: bool | None = None) -> RequestDelta:
    """`answering` defaults to: some answer text in this delta."""
    c = CompletionDelta(0, reasoning + content, list(range(tokens)), None, finish, None, reasoning, content, thinking,
                        bool(content) if answering is None else answering)
    return RequestDelta("r", 3, 0, finish is not None, None, [c])


def _set(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk's delta without its null keys (the content key is null in a chunk of thinking or calls)."""
    return {k: v for k, v in chunk["choices"][0]["delta"].items() if v is not None}


def test_tool_calls_are_read_from_the_answer_never_from_the_thinking() -> None:
    body = ChatCompletionRequest.model_validate({"messages": ASK, "stream": True})
    deltas = [_delta(f"let me see: {CALL}", "", tokens=20, thinking=20), _delta("", "No call.", "stop", 3, 20)]
    fmt = _ChatFormat(_fake_state("qwen3"), body, "id", HermesToolParser())
    choice = _Choice()
    for d in deltas:
        choice.add(d.outputs[0])
    message = fmt.full_response([choice], UsageInfo())["choices"][0]
    assert message["message"]["content"] == "No call." and message["message"]["tool_calls"] == []
    assert message["message"]["reasoning"] == message["message"]["reasoning_content"] == f"let me see: {CALL}"
    assert message["finish_reason"] == "stop"
    chunks = [ch for d in deltas for ch in fmt.stream_chunks(0, d)]
    assert [_set(ch) for ch in chunks] == [{"reasoning": f"let me see: {CALL}", "reasoning_content": f"let me see: {CALL}"},
                                          {"content": "No call."}]
    # the same call in the answer is a call
    fmt = _ChatFormat(_fake_state("qwen3"), body, "id", HermesToolParser())
    choice = _Choice()
    choice.add(_delta("hmm", CALL, "stop", 30, 5).outputs[0])
    out = fmt.full_response([choice], UsageInfo())["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == ["get_weather"]


def test_one_delta_with_both_sends_the_thinking_first() -> None:
    body = ChatCompletionRequest.model_validate({"messages": ASK, "stream": True})
    fmt = _ChatFormat(_fake_state("qwen3"), body, "id")
    chunks = fmt.stream_chunks(0, _delta("think", "answer", "stop", 4, 2))
    assert [ch["choices"][0]["delta"] for ch in chunks] == [
        {"content": None, "reasoning": "think", "reasoning_content": "think"}, {"content": "answer"}]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, "stop"]
    hidden = _ChatFormat(_fake_state("qwen3"), body.model_copy(update={"include_reasoning": False}), "id")
    assert [ch["choices"][0]["delta"] for ch in hidden.stream_chunks(0, _delta("think", "answer", "stop", 4, 2))] == [
        {"content": "answer"}]
    plain = _ChatFormat(_fake_state(None), body, "id")  # no parser: the whole text, as before
    assert [ch["choices"][0]["delta"] for ch in plain.stream_chunks(0, _delta("", "all", "stop"))] == [{"content": "all"}]


def test_responses_stream_puts_the_reasoning_item_first() -> None:
    body = ResponsesRequest(input="q", stream=True)
    fmt = _ResponsesFormat(_fake_state("qwen3"), body, "resp-1", None)
    events = fmt.stream_start(1) + fmt.stream_chunks(0, _delta("th", "", tokens=2, thinking=2))
    events += fmt.stream_chunks(0, _delta("ink", "ans", "stop", 3, 3))
    usage = UsageInfo(prompt_tokens=3, completion_tokens=5, total_tokens=8,
                      completion_tokens_details=CompletionTokensDetails(reasoning_tokens=3))
    events += fmt.stream_end(usage)
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.completed", None)]
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    assert events[6]["text"] == "think" and events[8]["item"]["content"] == [{"type": "reasoning_text", "text": "think"}]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0] == {"type": "reasoning", "id": "rs_resp-1", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": "think"}], "status": "completed"}
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


def test_serve_flags() -> None:
    import argparse

    from tandem.server.cli import add_serve_parser, reasoning_parser_name

    root = argparse.ArgumentParser()
    add_serve_parser(root.add_subparsers())
    args = root.parse_args(["serve", "--reasoning-parser", "qwen3", "--thinking-token-budget", "5",
                            "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert reasoning_parser_name(args) == "qwen3" and args.thinking_token_budget == 5
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert reasoning_parser_name(root.parse_args(["serve", "--reasoning-markers", "<r>,</r>"])) == "generic"
    assert reasoning_parser_name(root.parse_args(["serve"])) is None
    for bad in ("[1]", "{nope", '{"tokenize": true}'):
        with pytest.raises(SystemExit):
            root.parse_args(["serve", "--default-chat-template-kwargs", bad])


# =============================================================================================== the server
class Srv:
    def __init__(self, url: str) -> None:
        self.url = url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300.0)

    def chat(self, messages: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
        extra = dict(kw.pop("extra_body", {}))
        for key in ("thinking_token_budget", "chat_template_kwargs", "include_reasoning", "logit_bias", "ignore_eos"):
            if key in kw:
                extra[key] = kw.pop(key)
        create: Any = self.client().chat.completions.create
        return create(model=MODEL, messages=messages or ASK, extra_body=extra, **{"temperature": 0, **kw})

    def raw(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}{path}", json={"model": MODEL, **body}, timeout=300.0)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8", "--num-kv-blocks", "200",
               "--log-level", "warning"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    log_path = tmp_path_factory.mktemp("reasoning") / "server.log"
    args = [*SERVER_ARGS, "--reasoning-parser", "qwen3", "--thinking-token-budget", str(DEFAULT_BUDGET)]
    with running_server(log_path, str(qwen3_6_model()), args, os.environ) as (_, url):
        yield Srv(url)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(qwen3_6_model())


def _extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def _valid_call(call: Any, tools: list[dict[str, Any]]) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id and call.type == "function"


@pytest.mark.slow
def test_thinking_with_a_budget(srv: Srv) -> None:
    r = srv.chat(max_tokens=24, thinking_token_budget=8, logit_bias=NO_MARKERS, ignore_eos=True)
    ch = r.choices[0]
    extra = _extra(ch.message)
    assert extra["reasoning"] == extra["reasoning_content"] and extra["reasoning"]
    assert isinstance(ch.message.content, str) and ch.message.content and ch.finish_reason == "length"
    for text in (extra["reasoning"], ch.message.content):
        assert "<think>" not in text and "</think>" not in text
    u = r.usage
    assert u.completion_tokens == 24 and u.completion_tokens_details.reasoning_tokens == 9  # the forced </think> counts
    assert u.completion_tokens_details.reasoning_tokens <= u.completion_tokens
    # no budget in the request: the server's --thinking-token-budget
    u = srv.chat(max_tokens=16, logit_bias=NO_MARKERS, ignore_eos=True).usage
    assert u.completion_tokens_details.reasoning_tokens == DEFAULT_BUDGET + 1


@pytest.mark.slow
def test_thinking_that_never_ends(srv: Srv) -> None:
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "thinking_token_budget": 1000, "logit_bias": NO_MARKERS}
    r = srv.raw("/v1/chat/completions", body)
    ch = r["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["content"] is None  # null, not absent
    assert ch["message"]["reasoning"] == ch["message"]["reasoning_content"] and ch["message"]["reasoning"]
    assert r["usage"]["completion_tokens"] == r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    sdk = srv.chat(max_tokens=12, thinking_token_budget=1000, logit_bias=NO_MARKERS).choices[0]
    assert sdk.message.content is None and _extra(sdk.message)["reasoning"] == ch["message"]["reasoning"]


@pytest.mark.slow
def test_thinking_turned_off(srv: Srv, tokenizer: Tokenizer) -> None:
    """enable_thinking=false (or thinking=false, or reasoning_effort="none"): the prompt closes an empty block, the
    whole output is the answer: exactly the text a plain completion of that prompt gets."""
    prompt = tokenizer.render_chat(ASK, True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    plain = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    answers = []
    for kw in ({"chat_template_kwargs": {"enable_thinking": False}}, {"chat_template_kwargs": {"thinking": False}},
               {"reasoning_effort": "none"}):
        r = srv.chat(max_tokens=10, **kw)
        ch = r.choices[0]
        assert "reasoning" not in _extra(ch.message) and "reasoning_content" not in _extra(ch.message)
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        answers.append(ch.message.content)
    assert answers == [plain.choices[0].text] * 3
    # reasoning_effort "none" gives way to the request's own chat_template_kwargs
    r = srv.chat(max_tokens=10, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}, logit_bias=NO_MARKERS)
    assert _extra(r.choices[0].message)["reasoning"] and r.usage.completion_tokens_details.reasoning_tokens == 7


@pytest.mark.slow
def test_completions_take_a_thinking_budget(srv: Srv, tokenizer: Tokenizer) -> None:
    """/v1/completions: thinking_token_budget forces the end marker; the text stays the whole output."""
    prompt = tokenizer.render_chat(ASK, True)
    assert prompt.endswith("<think>\n")
    r = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"thinking_token_budget": 3, "logit_bias": NO_MARKERS, "ignore_eos": True})
    ids = tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    assert QWEN36_END_THINK in ids and r.choices[0].text.count("</think>") == 1
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 4


@pytest.mark.slow
def test_json_answer_after_the_thinking(srv: Srv) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = srv.chat(max_tokens=80, thinking_token_budget=8, response_format=rf)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch.message.content
    jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    assert _extra(ch.message)["reasoning"] and r.usage.completion_tokens_details.reasoning_tokens == 9
    parsed = srv.client().chat.completions.parse(model=MODEL, messages=ASK, response_format=City, temperature=0,  # type: ignore[arg-type]
                                                 max_tokens=80, extra_body={"thinking_token_budget": 8})
    assert isinstance(parsed.choices[0].message.parsed, City) and _extra(parsed.choices[0].message)["reasoning"]


@pytest.mark.slow
def test_forced_tool_calls_come_from_the_answer(srv: Srv) -> None:
    tools = [WEATHER, TIME]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = srv.chat(tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=80, thinking_token_budget=8)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1 and ch.message.content is None
        _valid_call(ch.message.tool_calls[0], tools)
        if isinstance(choice, dict):
            assert ch.message.tool_calls[0].function.name == "get_time"
        thought = _extra(ch.message)["reasoning"]
        assert thought and "<tool_call>" not in thought and r.usage.completion_tokens_details.reasoning_tokens == 9
    # streamed: the thinking first, then the call's pieces (the tool parser sees the answer only)
    kw: dict[str, Any] = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80,
                          "thinking_token_budget": 8}
    whole = srv.chat(**kw).choices[0]
    kinds, thought, args, names = [], "", "", []
    for chunk in srv.chat(**kw, stream=True):
        for c in chunk.choices:
            d = _extra(c.delta)
            if d.get("reasoning"):
                kinds.append("reasoning")
                thought += d["reasoning"]
            for t in c.delta.tool_calls or ():
                kinds.append("call")
                names += [t.function.name] if t.function.name else []
                args += t.function.arguments or ""
            assert not c.delta.content
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert thought == _extra(whole.message)["reasoning"]
    assert names == [whole.message.tool_calls[0].function.name] and args == whole.message.tool_calls[0].function.arguments


@pytest.mark.slow
def test_auto_tool_choice_while_thinking(srv: Srv) -> None:
    for budget in (4, 1000):
        r = srv.chat(tools=[WEATHER], tool_choice="auto", max_tokens=40, thinking_token_budget=budget)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        for call in ch.message.tool_calls or ():
            _valid_call(call, [WEATHER])
        if budget == 1000 and ch.message.content is None:  # still thinking at max_tokens: no calls
            assert not ch.message.tool_calls and _extra(ch.message)["reasoning"]


def _stream(srv: Srv, **kw: Any) -> tuple[list[tuple[int, str, str]], Any]:
    """(index, kind, text) of every non-empty delta, and the usage."""
    out, usage = [], None
    for chunk in srv.chat(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            d = _extra(c.delta)
            assert d.get("reasoning") == d.get("reasoning_content")
            assert not (d.get("reasoning") and c.delta.content), "a chunk carries thinking or answer, not both"
            if d.get("reasoning"):
                out.append((c.index, "reasoning", d["reasoning"]))
            if c.delta.content:
                out.append((c.index, "content", c.delta.content))
    return out, usage


def _joined(pieces: list[tuple[int, str, str]], index: int, kind: str) -> str:
    return "".join(t for i, k, t in pieces if i == index and k == kind)


def _thinking_first(pieces: list[tuple[int, str, str]], index: int) -> None:
    kinds = [k for i, k, _ in pieces if i == index]
    assert "reasoning" in kinds and "content" in kinds
    assert kinds.index("content") > len(kinds) - 1 - kinds[::-1].index("reasoning")


@pytest.mark.slow
def test_stream_matches_the_message(srv: Srv) -> None:
    kw: dict[str, Any] = {"max_tokens": 20, "thinking_token_budget": 5, "logit_bias": NO_MARKERS, "ignore_eos": True}
    whole = srv.chat(**kw)
    pieces, usage = _stream(srv, **kw)
    _thinking_first(pieces, 0)
    assert _joined(pieces, 0, "reasoning") == _extra(whole.choices[0].message)["reasoning"]
    assert _joined(pieces, 0, "content") == whole.choices[0].message.content
    assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens_details.reasoning_tokens == 6
    # include_reasoning=false: no thinking anywhere, the same answer
    hidden = srv.chat(**kw, include_reasoning=False)
    assert not {"reasoning", "reasoning_content"} & set(_extra(hidden.choices[0].message))
    assert hidden.choices[0].message.content == whole.choices[0].message.content
    pieces, usage = _stream(srv, **kw, include_reasoning=False)
    assert {k for _, k, _ in pieces} == {"content"} and _joined(pieces, 0, "content") == whole.choices[0].message.content
    assert usage.completion_tokens_details.reasoning_tokens == 6  # still counted


@pytest.mark.slow
def test_n_completions_each_split(srv: Srv) -> None:
    kw: dict[str, Any] = {"max_tokens": 16, "n": 2, "temperature": 1.0, "seed": 3, "thinking_token_budget": 5,
                          "logit_bias": NO_MARKERS, "ignore_eos": True}
    r = srv.chat(**kw)
    assert r.usage.completion_tokens_details.reasoning_tokens == 12 and r.usage.completion_tokens == 32
    for ch in r.choices:
        assert _extra(ch.message)["reasoning"] and ch.message.content and "</think>" not in ch.message.content
    assert r.choices[0].message.content != r.choices[1].message.content  # sampled: two different completions
    pieces, usage = _stream(srv, **kw)
    for ch in r.choices:
        _thinking_first(pieces, ch.index)
        assert _joined(pieces, ch.index, "reasoning") == _extra(ch.message)["reasoning"]
        assert _joined(pieces, ch.index, "content") == ch.message.content
    assert usage.completion_tokens_details.reasoning_tokens == 12


@pytest.mark.slow
def test_history_thinking_reaches_the_template(srv: Srv) -> None:
    """Qwen3's template renders the thinking of an assistant turn after the last user query: here a tool-call turn."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    thought = "The user wants the weather in Paris, so I call the tool."

    def prompt_tokens(**reasoning: str) -> int:
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call], **reasoning},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
        return int(srv.chat(history, tools=[WEATHER], max_tokens=2, thinking_token_budget=1).usage.prompt_tokens)

    without, with_new, with_old = prompt_tokens(), prompt_tokens(reasoning=thought), prompt_tokens(reasoning_content=thought)
    assert with_new == with_old > without + 10
    # the Responses API: a reasoning item before the function call
    items: list[dict[str, Any]] = [{"role": "user", "content": ASK[0]["content"]},
                                   {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                    "arguments": call["function"]["arguments"]},  # type: ignore[index]
                                   {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    tools = [{"type": "function", **WEATHER["function"]}]  # type: ignore[dict-item]
    c = srv.client()
    plain = c.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=2, temperature=0)  # type: ignore[arg-type]
    rs = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]}
    thinking = c.responses.create(model=MODEL, input=[items[0], rs, *items[1:]], tools=tools, max_output_tokens=2,  # type: ignore[arg-type]
                                  temperature=0)
    assert plain.usage is not None and thinking.usage is not None
    assert thinking.usage.input_tokens == with_new and plain.usage.input_tokens == without


@pytest.mark.slow
def test_client_gone_mid_thought(srv: Srv) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 400, "stream": True, "thinking_token_budget": 1000,
            "logit_bias": NO_MARKERS}
    saw_thinking = False
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60.0) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"reasoning"' in line:
                saw_thinking = True
                break
    assert saw_thinking
    deadline = time.monotonic() + 30
    while httpx.get(f"{srv.url}/health").json()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{srv.url}/health").json()["in_flight"] == 0
    r2 = srv.chat(max_tokens=12, thinking_token_budget=4)
    assert _extra(r2.choices[0].message)["reasoning"] and r2.usage.completion_tokens_details.reasoning_tokens == 5


@pytest.mark.slow
def test_responses_reasoning_item(srv: Srv) -> None:
    c = srv.client()
    kw: dict[str, Any] = {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 20, "temperature": 0,
                          "extra_body": {"thinking_token_budget": 5}}
    r = c.responses.create(**kw, reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.summary == [] and rs.status == "completed"  # type: ignore[union-attr]
    assert rs.content is not None and len(rs.content) == 1 and rs.content[0].type == "reasoning_text"  # type: ignore[union-attr]
    assert rs.content[0].text and r.output_text and r.usage is not None  # type: ignore[union-attr]
    assert r.usage.output_tokens_details.reasoning_tokens == 6
    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    first_message = kinds.index("response.output_text.delta")
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.index("response.output_item.done") < first_message
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.usage.output_tokens_details.reasoning_tokens == 6
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas and all(e.item_id == final.output[0].id and e.output_index == 0 and e.content_index == 0 for e in deltas)  # type: ignore[union-attr]
    assert "".join(e.delta for e in deltas) == rs.content[0].text  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == rs.content[0].text  # type: ignore[union-attr]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text  # type: ignore[union-attr]
    # a forced call, streamed: the reasoning item is closed before the call's item opens at output index 1
    tools = [{"type": "function", **WEATHER["function"]}]  # type: ignore[dict-item]
    events = list(c.responses.create(**{**kw, "max_output_tokens": 80}, tools=tools, tool_choice="required", stream=True))  # type: ignore[arg-type]
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert added == [(0, "reasoning"), (1, "function_call")]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    jsonschema.validate(json.loads(final.output[1].arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    # effort "none": no thinking, no reasoning item
    off = c.responses.create(**kw, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------- the client libraries
@pytest.mark.slow
def test_pydantic_ai_gets_thinking_and_text_parts(srv: Srv) -> None:
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.messages import ModelResponse, TextPart, ThinkingPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    extra = {"thinking_token_budget": 8, "logit_bias": NO_MARKERS, "ignore_eos": True}
    direct = srv.chat(max_tokens=24, **extra).choices[0].message
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{srv.url}/v1", api_key="none"))
    agent = Agent(model, model_settings=ModelSettings(temperature=0, max_tokens=24, extra_body=extra), retries=0)

    def parts(messages: list[Any]) -> list[tuple[str, str]]:
        response = [m for m in messages if isinstance(m, ModelResponse)][-1]
        return [(type(p).__name__, p.content) for p in response.parts if isinstance(p, (ThinkingPart, TextPart))]

    result = agent.run_sync(ASK[0]["content"])
    assert parts(result.all_messages()) == [("ThinkingPart", _extra(direct)["reasoning"]), ("TextPart", direct.content)]
    assert result.output == direct.content

    async def streamed() -> list[Any]:
        async with agent.run_stream(ASK[0]["content"]) as run:
            await run.get_output()
            return run.all_messages()

    got = parts(asyncio.run(streamed()))
    assert got[0] == ("ThinkingPart", _extra(direct)["reasoning"])
    assert "".join(t for k, t in got if k == "TextPart").strip() == direct.content.strip()


@pytest.mark.slow
def test_agents_sdk_reasoning_items(srv: Srv) -> None:
    """The Agents SDK on /v1/responses, with a typed output (a random model ends its answer only under a grammar; the
    SDK fails an incomplete response): the thinking arrives as a ReasoningItem, goes back as input after a tool call."""
    from agents import (
        Agent,
        MessageOutputItem,
        ModelSettings,
        OpenAIResponsesModel,
        ReasoningItem,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ItemHelpers
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)
    direct = srv.client().responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=24, temperature=0,
                                           extra_body={"thinking_token_budget": 8})

    sent: list[dict[str, Any]] = []  # the request bodies

    async def record(request: Any) -> None:
        sent.append(json.loads(request.content))

    def model() -> Any:  # an async client of its own per event loop
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]})
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, http_client=http)
        return OpenAIResponsesModel(MODEL, openai_client=client)

    settings = ModelSettings(temperature=0, max_tokens=80, reasoning=Reasoning(effort="low"),
                             extra_body={"thinking_token_budget": 8})
    agent = Agent(name="thinker", model=model(), model_settings=settings, output_type=City)
    result = Runner.run_sync(agent, ASK[0]["content"])
    assert [type(i) for i in result.new_items] == [ReasoningItem, MessageOutputItem]
    thought = result.new_items[0].raw_item.content
    assert thought is not None and thought[0].text == direct.output[0].content[0].text  # type: ignore[union-attr]
    assert isinstance(result.final_output, City)
    assert City.model_validate_json(ItemHelpers.text_message_output(result.new_items[1])) == result.final_output  # type: ignore[arg-type]

    # a tool turn, then the answer: the first turn's reasoning item goes back in the second request's input
    seen: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not seen)  # offered until called once: a random model calls on
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "18 C"

    tool_agent = Agent(name="weather", model=model(), tools=[get_weather], output_type=City,
                       model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                                    extra_body={"thinking_token_budget": 4}))
    result = Runner.run_sync(tool_agent, "What is the weather in Paris?", max_turns=3)
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ReasoningItem", "ToolCallItem", "ToolCallOutputItem", "ReasoningItem", "MessageOutputItem"], kinds
    assert seen and isinstance(result.final_output, City)
    follow_up = [item.get("type", "message") for item in sent[-1]["input"]]
    assert follow_up == ["message", "reasoning", "function_call", "function_call_output"], follow_up

    async def streamed() -> tuple[Any, set[str]]:
        run = Runner.run_streamed(agent.clone(model=model()), ASK[0]["content"])
        raw = {e.data.type async for e in run.stream_events() if e.type == "raw_response_event"}
        return run.final_output, raw

    output, raw = asyncio.run(streamed())
    assert isinstance(output, City) and {"response.reasoning_text.delta", "response.reasoning_text.done"} <= raw


# ------------------------------------------------- a server whose grammars hold the thinking (enable_in_reasoning)
@pytest.fixture(scope="module")
def held_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    log_path = tmp_path_factory.mktemp("held-reasoning") / "server.log"
    args = [*SERVER_ARGS, "--reasoning-parser", "qwen3", "--thinking-token-budget", str(DEFAULT_BUDGET),
            "--structured-outputs-config", '{"enable_in_reasoning": true}']
    with running_server(log_path, str(qwen3_6_model()), args, os.environ) as (_, url):
        yield Srv(url)


@pytest.mark.slow
def test_the_engine_wide_switch_over_http(held_srv: Srv) -> None:
    """vLLM's `--structured-outputs-config '{"enable_in_reasoning": true}'`: distinct grammars at once, each spelling
    its own thinking, the end marker and a JSON answer, hold the whole output (the server's default budget is not
    applied to them: a forced end would leave the grammar); the split follows the marker. A guided request that asks
    for a budget gets a 400 naming it; a free one keeps the server's default budget."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(n: int) -> Any:
        compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}  # random weights would pad it with spaces
        grammar = f'start: THOUGHT <[{QWEN36_END_THINK}]> %json {json.dumps(compact)}\nTHOUGHT: /[a-z]{{{n},{n + 2}}}/\n'
        return held_srv.chat(max_tokens=48, extra_body={"structured_outputs": {"grammar": grammar, "backend": "llguidance"}})

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, (2, 5, 8)))
    for n, r in zip((2, 5, 8), answers):
        ch = r.choices[0]
        thought = _extra(ch.message)["reasoning"]
        assert ch.finish_reason == "stop" and n <= len(thought.strip()) <= n + 2 and thought.strip().isalpha()
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        held_srv.chat(max_tokens=24, thinking_token_budget=4, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    u = held_srv.chat(max_tokens=16, logit_bias=NO_MARKERS, ignore_eos=True).usage
    assert u.completion_tokens_details.reasoning_tokens == DEFAULT_BUDGET + 1


@pytest.mark.slow
def test_tool_call_grammars_stay_after_the_thinking_under_the_switch(held_srv: Srv) -> None:
    """The call grammars of a text tool format are the answer's: under the engine-wide switch a forced call still
    follows the thinking (ended by the server's default budget) and is read from the answer, as without it."""
    tools = [WEATHER, TIME]
    r = held_srv.chat(tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80, logit_bias=NO_MARKERS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1 and ch.message.content is None
    _valid_call(ch.message.tool_calls[0], tools)
    thought = _extra(ch.message)["reasoning"]
    assert thought and "<tool_call>" not in thought
    assert r.usage.completion_tokens_details.reasoning_tokens == DEFAULT_BUDGET + 1


# --------------------------------------------------------------------------------- a server without a parser
@pytest.fixture(scope="module")
def plain_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    log_path = tmp_path_factory.mktemp("no-reasoning") / "server.log"
    args = [*SERVER_ARGS, "--default-chat-template-kwargs", '{"enable_thinking": false}']
    with running_server(log_path, str(qwen3_6_model()), args, os.environ) as (_, url):
        yield Srv(url)


@pytest.mark.slow
def test_without_a_parser_nothing_changes(plain_srv: Srv, tokenizer: Tokenizer) -> None:
    body = {"messages": ASK, "max_tokens": 10, "temperature": 0, "thinking_token_budget": 3}
    r = plain_srv.raw("/v1/chat/completions", body)
    message = r["choices"][0]["message"]
    assert set(message) == {"role", "content", "tool_calls"} and set(r["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    # --default-chat-template-kwargs closed the block in the prompt; the request's own kwargs win
    closed = tokenizer.encode(tokenizer.render_chat(ASK, True, enable_thinking=False), add_special_tokens=False)
    opened = tokenizer.encode(tokenizer.render_chat(ASK, True), add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == len(closed)
    on = plain_srv.raw("/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": True}})
    assert on["usage"]["prompt_tokens"] == len(opened) and "reasoning" not in on["choices"][0]["message"]
    assert on["choices"][0]["message"]["content"]  # no parser: the thinking is content too
    with httpx.stream("POST", f"{plain_srv.url}/v1/chat/completions", json={"model": MODEL, **body, "stream": True,
                                                                               "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert all(not {"reasoning", "reasoning_content"} & set(ch["delta"]) for chunk in chunks for ch in chunk["choices"])
    assert "completion_tokens_details" not in chunks[-1]["usage"]
    assert "".join(ch["delta"].get("content") or "" for chunk in chunks for ch in chunk["choices"]) == message["content"]
    completion = plain_srv.raw("/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert set(completion["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    resp = plain_srv.raw("/v1/responses", {"input": ASK[0]["content"], "max_output_tokens": 10, "temperature": 0})
    assert [o["type"] for o in resp["output"]] == ["message"] and resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
