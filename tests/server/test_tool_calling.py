"""Tool calling and the rest of the client surface against a real `tandem serve` (demo model, whose template knows no
tools: the fallback format), driven by the client libraries people point at OpenAI-compatible servers, each in the
mode its users get by default: the openai SDK, LangChain's ChatOpenAI, instructor, pydantic-ai.

Pydantic fields carry max_length where a free string would let a 135M model loop until max_tokens: that bounds the
grammar (as users of small models do), it does not hide a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.launch import running_server
from tests.server.test_server import demo
from tests.tools.corpus import load_corpus, tool, tool_set

MODEL = "tandem-demo"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    """The weather asked about."""

    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


class Srv:
    def __init__(self, url: str) -> None:
        self.url = url

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300.0, **kw)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    log_path = tmp_path_factory.mktemp("tools") / "server.log"
    args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "16", "--num-kv-blocks", "600",
            "--log-level", "warning"]
    with running_server(log_path, None, args, os.environ) as (_, url):
        yield Srv(url)


def _valid(call: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    assert call.id and call.type == "function"
    return args


# ------------------------------------------------------------------------------------------- the openai SDK
@demo
def test_named_required_and_none(srv: Srv) -> None:
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=120,
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    assert ch.message.tool_calls[0].function.name == "get_time"
    _valid(ch.message.tool_calls[0], [WEATHER, TIME])
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    _valid(ch.message.tool_calls[0], [WEATHER, TIME])
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


@demo
def test_streamed_tool_calls_match_the_unstreamed_answer(srv: Srv) -> None:
    c = srv.client()
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
                          "temperature": 0, "max_tokens": 150, "parallel_tool_calls": True}
    whole = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    finish, usage = None, None
    for chunk in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "id and name come once, in a call's first delta"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    assert usage is not None and usage.completion_tokens > 0
    complete = [calls[i] for i in sorted(calls)][: len(whole.message.tool_calls)]
    assert [(e["name"], e["arguments"]) for e in complete] == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert finish == whole.finish_reason
    for e in complete:
        jsonschema.validate(json.loads(e["arguments"]), next(t["function"]["parameters"] for t in [WEATHER, TIME]
                                                                  if t["function"]["name"] == e["name"]))
    # named, streamed through the SDK's stream helper (it assembles the calls): the unstreamed answer
    kw = {**kw, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 120}
    whole = c.chat.completions.create(**kw).choices[0]
    with c.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    got = [(t.function.name, t.function.arguments) for t in final.message.tool_calls or ()]
    assert got and got == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
    assert final.finish_reason == whole.finish_reason == "tool_calls"


@demo
def test_parse_with_pydantic_function_tool(srv: Srv) -> None:
    """chat.completions.parse with a strict pydantic tool: the SDK validates the arguments into the model."""
    c = srv.client()
    r = c.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                 tool_choice={"type": "function", "function": {"name": "Weather"}}, temperature=0, max_tokens=100)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather)


@demo
def test_tool_results_in_the_history(srv: Srv) -> None:
    """An assistant turn with tool_calls and a role "tool" answer go back through the (fallback) template."""
    c = srv.client()
    first = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                      parallel_tool_calls=False, temperature=0, max_tokens=100).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "cloudy"}'}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    assert r.usage is not None and r.usage.prompt_tokens > 100


@demo
def test_auto_calls_are_valid_when_made(srv: Srv) -> None:
    """The model decides: whatever comes back is text or valid calls (auto calls that surely happen, with the trigger
    pushed: tests/tools/test_corpus_engine.py, tests/server/test_tool_template.py)."""
    c = srv.client()
    for content in ("Call get_weather for Paris.", "Hi!"):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], tools=[WEATHER, TIME],
                                      tool_choice="auto", temperature=0, max_tokens=80)
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert ch.finish_reason in ("tool_calls", "length")
            for call in ch.message.tool_calls:
                _valid(call, [WEATHER, TIME])


@demo
def test_corpus_sample_through_the_server(srv: Srv) -> None:
    """A sample of the function corpus (distinct tool sets) through HTTP, sent at once: every named / required call
    validates (the whole corpus through the engine: tests/tools, `tandem bench tools`)."""
    corpus = load_corpus()
    c = srv.client()
    jobs = []
    for i in range(0, len(corpus), 26):
        entry, tools = corpus[i], tool_set(corpus, i)
        for choice in ("required", {"type": "function", "function": {"name": entry["function"]["name"]}}):
            jobs.append((tools, entry, choice))

    def ask(job: tuple[Any, ...]) -> Any:
        tools, entry, choice = job
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": entry["prompt"]}], tools=tools,
                                         tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=160).choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    lengths = 0
    for (tools, entry, _), ch in zip(jobs, answers):
        if ch.finish_reason == "length":
            lengths += 1
            continue
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        _valid(ch.message.tool_calls[0], [*tools, tool(entry)])
    assert lengths <= 2  # a 135M model now and then loops in a free string until max_tokens


# ------------------------------------------------------------------------------------------------- the rest
@demo
def test_bad_tool_requests_are_400(srv: Srv) -> None:
    c = srv.client()
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        c.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "narrator", "content": "x"}], max_tokens=5)  # type: ignore[misc,list-item]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=4000)


@demo
def test_completions_echo_with_prompt_logprobs(srv: Srv) -> None:
    c = srv.client()
    r = c.completions.create(model=MODEL, prompt="The capital of France is", echo=True, logprobs=2, max_tokens=3, temperature=0)
    ch = r.choices[0]
    assert ch.text.startswith("The capital of France is") and len(ch.text) > len("The capital of France is")
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text and len(lp.tokens) == len(lp.text_offset)
    plain = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0).choices[0].text
    assert ch.text == "The capital of France is" + plain
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model=MODEL, prompt="The capital of France is", echo=True, max_tokens=3, temperature=0, stream=True) if x.choices)
    assert streamed == ch.text


@demo
def test_json_object_and_strict_json_schema(srv: Srv) -> None:
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object about a cat."}],
                                  response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    parsed = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=Weather, temperature=0, max_tokens=80)
    assert isinstance(parsed.choices[0].message.parsed, Weather)


# ------------------------------------------------------------------------------------- the client libraries
@demo
def test_langchain_structured_output_and_bind_tools(srv: Srv) -> None:
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{srv.url}/v1", api_key="none", temperature=0, max_tokens=120, max_retries=0)  # type: ignore[arg-type]
    out = llm.with_structured_output(Weather).invoke("What is the weather in Paris?")  # default: json_schema
    assert isinstance(out, Weather)
    out = llm.with_structured_output(Weather, method="function_calling").invoke("What is the weather in Paris?")
    assert isinstance(out, Weather)

    @lc_tool
    def get_time(timezone: str) -> str:
        """Current time in an IANA time zone."""
        return "12:00"

    msg = llm.bind_tools([get_time], tool_choice="any").invoke("What time is it in Tokyo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_time"  # type: ignore[attr-defined]
    assert isinstance(msg.tool_calls[0]["args"]["timezone"], str)  # type: ignore[attr-defined]
    msg = llm.bind_tools([get_time]).invoke("What time is it in Tokyo?")  # auto: text or a valid call
    for call in msg.tool_calls:  # type: ignore[attr-defined]
        assert call["name"] == "get_time" and isinstance(call["args"]["timezone"], str)


@demo
def test_instructor_default_mode(srv: Srv) -> None:
    import instructor

    client = instructor.from_openai(srv.client())
    assert client.mode == instructor.Mode.TOOLS
    out = client.chat.completions.create(model=MODEL, response_model=Weather, messages=ASK, temperature=0, max_tokens=120,
                                         max_retries=0)
    assert isinstance(out, Weather)


@demo
def test_pydantic_ai_default_output(srv: Srv) -> None:
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{srv.url}/v1", api_key="none"))
    agent = Agent(model, output_type=Weather, model_settings=ModelSettings(temperature=0, max_tokens=120), retries=0)
    result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, Weather)  # the default output mode: a tool call of the output tool

    # a function tool beside the output tool: "required" over their union; whichever the model calls, it validates.
    # The tool is offered until it has been called once (a 135M model would call it again and again).
    seen: list[str] = []
    tools_agent = Agent(model, output_type=Weather, model_settings=ModelSettings(temperature=0, max_tokens=120), retries=0)

    async def until_called(ctx: Any, tool_def: Any) -> Any:
        return None if seen else tool_def

    @tools_agent.tool_plain(prepare=until_called)
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"18 C and cloudy in {city}"

    result = tools_agent.run_sync("Use get_weather to find the weather in Paris, then report it.",
                                  usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, Weather) and all(isinstance(c, str) for c in seen)
    names = [p.tool_name for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert names and names[-1] == "final_result" and set(names) <= {"get_weather", "final_result"}


# ------------------------------------------------------------------------------------- the Responses API
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                     "parameters": WEATHER["function"]["parameters"], "strict": False}


@demo
def test_responses_text_stream_and_structured_output(srv: Srv) -> None:
    c = srv.client()
    kw: dict[str, Any] = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 20, "temperature": 0}
    # the prompt's first run computes it whole, later ones find it in the prefix cache; in bfloat16 the two attention
    # paths round differently, and on an AVX2-only CPU this prompt's second token is a near tie between them (measured:
    # float32 runs agree), so the runs compared below both find the prompt cached
    c.responses.create(**kw, instructions="You are brief.")
    r = c.responses.create(**kw, instructions="You are brief.")
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage is not None and r.usage.output_tokens > 0
    events = list(c.responses.create(**kw, instructions="You are brief.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    parsed = c.responses.parse(model=MODEL, input="What is the weather in Paris?", text_format=Weather, max_output_tokens=80,
                               temperature=0)
    assert isinstance(parsed.output_parsed, Weather)


@demo
def test_responses_function_calls_round_trip_and_stream(srv: Srv) -> None:
    c = srv.client()
    kw: dict[str, Any] = {"model": MODEL, "tools": [RESPONSES_WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                          "max_output_tokens": 100, "temperature": 0}
    r = c.responses.create(input="What is the weather in Paris?", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    events = list(c.responses.create(input="What is the weather in Paris?", stream=True, **kw))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and pieces == done[0].arguments == calls[0].arguments
    history = [{"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, cloudy"}]
    follow = c.responses.create(model=MODEL, input=history, tools=[RESPONSES_WEATHER], tool_choice="none",  # type: ignore[arg-type]
                                max_output_tokens=30, temperature=0)
    assert follow.output_text and follow.usage is not None and follow.usage.input_tokens > r.usage.input_tokens  # type: ignore[union-attr]


@demo
def test_agents_sdk_default_mode(srv: Srv) -> None:
    """The OpenAI Agents SDK on its default model API (Responses): a function tool it runs, and a typed output."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    model = OpenAIResponsesModel(MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0))
    seen: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"18 C and cloudy in {city}"

    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=100)
    agent = Agent(name="weather", instructions="Use the weather tool.", model=model, tools=[get_weather],
                  model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert seen and result.final_output == f"18 C and cloudy in {seen[0]}"  # parallel calls are allowed by default
    typed = Agent(name="extract", instructions="Extract the city and unit.", model=model, output_type=Weather,
                  model_settings=ModelSettings(temperature=0, max_tokens=100))
    assert isinstance(Runner.run_sync(typed, "What is the weather in Paris, in celsius?").final_output, Weather)

    async def streamed() -> Any:  # a client of its own: an async client's connections belong to one event loop
        fresh = OpenAIResponsesModel(MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0))
        run = Runner.run_streamed(typed.clone(model=fresh), "What is the weather in Rome, in fahrenheit?")
        kinds = {e.type async for e in run.stream_events()}
        return run.final_output, kinds

    output, kinds = asyncio.run(streamed())
    assert isinstance(output, Weather) and "raw_response_event" in kinds


@demo
def test_health_after_tool_traffic(srv: Srv) -> None:
    assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
