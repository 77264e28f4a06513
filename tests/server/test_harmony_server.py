"""gpt-oss over HTTP (`tandem serve`; harmony brings its `openai_gptoss` reasoning parser): harmony renders the chat (tools,
reasoning_effort), the analysis channel comes back as `reasoning` / `reasoning_content`, the final channel as
`content`, messages to `functions.NAME` as `tool_calls` (whole and streamed alike), and `<|return|>` ends a request.
The first part replays recorded harmony outputs through the chat formatter (no server); the second drives a server
on tests/reasoning/harmony_models.py's tiny random-weight gpt-oss with the openai SDK (random weights write no
harmony: NO_MARKERS keeps markers out and the thinking budget forces the final channel).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from tandem.reasoning import GptOssReasoningParser
from tandem.server.api import _ChatFormat, _Choice
from tandem.server.engine_client import CompletionDelta, RequestDelta
from tandem.server.protocol import ChatCompletionRequest, UsageInfo
from tandem.tools.harmony import HarmonyChatFormat, harmony_encoding
from tandem.tools.parsers import OpenAIToolParser
from tests.reasoning import harmony_models as hm
from tests.server.launch import running_server

MODEL = hm.NAME
DATE = "2025-06-01"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_MARKERS = {str(m): -100 for m in (*hm.MARKERS, hm.PAD)}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
RECORDED = ("<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
ANSWERED = ("<|channel|>analysis<|message|>It is 21C.<|end|><|start|>assistant<|channel|>final<|message|>"
            "It is 21 °C in Paris.<|return|>")


# ============================================================================================ no server needed
def _deltas(text: str, every: int) -> list[RequestDelta]:
    """The engine core's deltas of a recorded output, `every` tokens at a time (its harmony split, as the core
    computes it; text as decoded without special tokens)."""
    enc = harmony_encoding()
    ids = list(enc.encode(text, allowed_special="all"))
    state = GptOssReasoningParser().start_state(None, enc.encode("<|start|>assistant", allowed_special="all"),  # type: ignore[arg-type]
                                                None, enc.decode)
    out, sent_r, sent_c = [], "", ""
    for i in range(0, len(ids), every):
        chunk = ids[i:i + every]
        state.feed(chunk)
        reasoning, content = state.split("", False)
        finish = "stop" if i + every >= len(ids) else None
        r, c = reasoning or "", content or ""
        delta = CompletionDelta(0, enc.decode([t for t in chunk if t < 199998]), chunk, None, finish, None,
                                r[len(sent_r):], c[len(sent_c):], state.num_reasoning_tokens, content is not None)
        sent_r, sent_c = r, c
        out.append(RequestDelta("r", 10, 0, finish is not None, None, [delta]))
    return out


def _state() -> Any:
    return SimpleNamespace(model_name=MODEL, reasoning_parser="openai_gptoss",
                           config=SimpleNamespace(reasoning_parser="openai_gptoss"))


@pytest.mark.parametrize("every", [1, 3, 1000])
def test_recorded_call_streams_and_answers_alike(every: int) -> None:
    hm.use_shared_vocabulary()
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER], "stream": True})
    deltas = _deltas(RECORDED, every)
    fmt = _ChatFormat(_state(), body, "id", OpenAIToolParser())
    choice = _Choice()
    for d in deltas:
        choice.add(d.outputs[0])
    whole = fmt.full_response([choice], UsageInfo())["choices"][0]
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["reasoning"] == message["reasoning_content"] == "The user wants the weather. Call the tool."
    [call] = message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    streamed = _ChatFormat(_state(), body, "id", OpenAIToolParser())
    chunks = [ch["choices"][0] for d in deltas for ch in streamed.stream_chunks(0, d)]
    reasoning = "".join(c["delta"].get("reasoning") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls") or []]
    assert reasoning == message["reasoning"] and not any(c["delta"].get("content") for c in chunks)
    assert [tc["function"]["name"] for tc in calls if tc.get("id")] == ["get_weather"]
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == call["function"]["arguments"]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_recorded_answer_is_the_final_channel() -> None:
    hm.use_shared_vocabulary()
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    choice = _Choice()
    for d in _deltas(ANSWERED, 2):
        choice.add(d.outputs[0])
    out = _ChatFormat(_state(), body, "id", OpenAIToolParser()).full_response([choice], UsageInfo())["choices"][0]
    assert (out["message"]["reasoning"], out["message"]["content"]) == ("It is 21C.", "It is 21 °C in Paris.")
    assert out["message"]["tool_calls"] == [] and out["finish_reason"] == "stop"


# ========================================================================================== a running server
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4", "--num-kv-blocks", "200",
               "--log-level", "warning"]  # no --reasoning-parser: harmony's chat format brings openai_gptoss


class Srv:
    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300.0)

    def chat(self, messages: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
        extra = dict(kw.pop("extra_body", {}))
        for key in ("thinking_token_budget", "chat_template_kwargs", "logit_bias"):
            if key in kw:
                extra[key] = kw.pop(key)
        extra.setdefault("chat_template_kwargs", {"conversation_start_date": DATE})
        create: Any = self.client.chat.completions.create
        return create(model=MODEL, messages=messages or ASK, extra_body=extra, **{"temperature": 0, **kw})


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    folder = hm.harmony_model()  # also points TIKTOKEN_ENCODINGS_BASE at the shared vocabulary (inherited)
    log_path = tmp_path_factory.mktemp("harmony") / "server.log"
    with running_server(log_path, str(folder), SERVER_ARGS, os.environ) as (_, url):
        yield Srv(url)


def _rendered(**kw: Any) -> int:
    return len(HarmonyChatFormat.load().render(ASK, conversation_start_date=DATE, **kw))


@pytest.mark.slow
def test_a_chat_is_rendered_by_harmony_and_answers_in_the_final_channel(srv: Srv) -> None:
    r = srv.chat(max_tokens=10, thinking_token_budget=0, logit_bias=NO_MARKERS, reasoning_effort="low")
    ch = r.choices[0]
    assert r.usage.prompt_tokens == _rendered(reasoning_effort="low")
    assert isinstance(ch.message.content, str) and ch.message.content and ch.finish_reason == "length"
    assert (ch.message.model_extra or {}).get("reasoning") is None
    assert r.usage.completion_tokens == 10 and r.usage.completion_tokens_details.reasoning_tokens == 3  # the forced header
    assert "<|" not in ch.message.content
    with pytest.raises(openai.BadRequestError, match="harmony knows low, medium, high"):
        srv.chat(max_tokens=4, reasoning_effort="none")


@pytest.mark.slow
def test_tools_are_rendered_and_read_by_the_openai_parser(srv: Srv) -> None:
    r = srv.chat(max_tokens=8, thinking_token_budget=0, logit_bias=NO_MARKERS, tools=[WEATHER])
    assert r.usage.prompt_tokens == _rendered(tools=[WEATHER]) and r.choices[0].message.tool_calls in (None, [])
    stream = srv.chat(max_tokens=8, thinking_token_budget=0, logit_bias=NO_MARKERS, tools=[WEATHER], stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == r.choices[0].message.content


@pytest.mark.slow
def test_required_forces_a_call_whole_and_streamed(srv: Srv) -> None:
    """A named function (and "required") holds the whole turn to harmony's call grammar (the analysis too): one
    call, valid arguments, finish_reason "tool_calls", the same streamed; a thinking budget cannot go with it (400).
    (get_time's enum keeps the random model's arguments short; get_weather's free string would run on.)"""
    kw: dict[str, Any] = {"max_tokens": 64, "tools": [WEATHER, TIME], "logit_bias": {str(hm.END): 100},
                          "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    r = srv.chat(**kw).choices[0]
    [call] = r.message.tool_calls
    assert r.finish_reason == "tool_calls" and call.function.name == "get_time"
    assert json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
    required = srv.chat(**{**kw, "tools": [TIME], "tool_choice": "required"}).choices[0]
    assert [c.function.name for c in required.message.tool_calls] == ["get_time"]
    chunks = [c.choices[0] for c in srv.chat(stream=True, **kw) if c.choices]
    streamed = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert [tc.function.name for tc in streamed if tc.id] == [call.function.name]
    assert "".join(tc.function.arguments or "" for tc in streamed) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        srv.chat(max_tokens=4, tools=[WEATHER], tool_choice="required", thinking_token_budget=4)


@pytest.mark.slow
def test_return_ends_the_request(srv: Srv) -> None:
    r = srv.chat(max_tokens=8, thinking_token_budget=0, logit_bias={**NO_MARKERS, str(hm.RETURN): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4  # <|channel|>final<|message|> forced
    assert r.choices[0].message.content == ""
