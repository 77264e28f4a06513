"""`tandem demo` section: tool calling. A request offers three functions with tool_choice "required"; the tool grammar
(a structural tag, masks filled on the CPU while the forward runs) holds the call to the chosen function's schema;
the call is parsed back and validated. Then requests with a distinct tool set each, as tool calls and as text at the
same lengths (the demo model's template knows no tools, so the fallback prompt of docs/tool_calling.md)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tandem.bench.common import drive
from tandem.demo.common import Rows, section, speed, stream
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams
from tandem.tools import ToolPlan, choose_parser

FUNCTIONS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"]}},
    {"name": "book_table", "description": "Book a restaurant table.",
     "parameters": {"type": "object", "properties": {
         "restaurant": {"type": "string", "maxLength": 40}, "party_size": {"type": "integer", "minimum": 1, "maximum": 20},
         "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, "required": ["restaurant", "party_size", "time"]}},
    {"name": "convert_currency", "description": "Convert an amount between currencies.",
     "parameters": {"type": "object", "properties": {
         "amount": {"type": "number", "minimum": 0}, "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
         "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}}, "required": ["amount", "from", "to"]}},
    {"name": "set_reminder", "description": "Set a reminder.",
     "parameters": {"type": "object", "properties": {
         "text": {"type": "string", "maxLength": 60}, "minutes_from_now": {"type": "integer", "minimum": 1, "maximum": 1440}},
         "required": ["text", "minutes_from_now"]}},
]
ASKS = ["What's the weather like in Lisbon? Celsius please.", "Book a table for 4 at Luigi's at 19:30.",
        "How much is 250 euros in dollars?", "Remind me to call Sam in 45 minutes."]


def _request(engine: LLMEngine, i: int, choice: str) -> tuple[ToolPlan, list[int]]:
    """Ask i over a tool set of its own (its function and the next two), rendered as the server renders it."""
    tools = [{"type": "function", "function": FUNCTIONS[(i + k) % len(FUNCTIONS)]} for k in (0, 1, 2)]
    plan = ToolPlan.build(tools, choice, False, *choose_parser("auto", engine.tokenizer.hf.chat_template,
                                                                   engine.tokenizer.chat_format.tool_call_parser))
    assert plan is not None
    messages = plan.conversation([{"role": "user", "content": ASKS[i % len(ASKS)]}])
    return plan, engine.tokenizer.apply_chat_template(messages, **plan.template_kwargs())


def tour_tools(engine: LLMEngine, rows: Rows, quick: bool) -> None:
    section('Tool calling: tool_choice "required" over three functions, the call held to its schema')
    plan, prompt = _request(engine, 1, "required")
    print(f"user: {ASKS[1]}\n(offered: {', '.join(f.name for f in plan.tools)})\nassistant: ", end="", flush=True)
    text = stream(engine, prompt, SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=plan.structured_outputs()))
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    for call in plan.parser.parse(text).tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        print(f"  -> tool_calls[0]: {call.name}({call.arguments}), valid against its schema")

    n = 8 if quick else 16
    reqs = [_request(engine, i, "required") for i in range(n)]
    prompts = [p for _, p in reqs]
    guided = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=r.structured_outputs()) for r, _ in reqs]
    lengths: dict[str, int] = {}
    drive(engine, prompts, SamplingParams(max_tokens=1), n, "prefill")  # both runs below find the prompts cached
    calls = drive(engine, prompts, guided, n, "tools", on_output=lambda o: lengths.__setitem__(o.request_id, len(o.outputs[0].token_ids)))
    same = [SamplingParams(temperature=0.0, min_tokens=lengths[f"tools-{i}"], max_tokens=lengths[f"tools-{i}"]) for i in range(n)]
    text_run = drive(engine, prompts, same, n, "text")
    print(f"  {n} requests, each with its own tool set: {calls.tok_per_s:.0f} tok/s as tool calls, "
          f"{text_run.tok_per_s:.0f} tok/s as text of the same lengths ({calls.tok_per_s / max(text_run.tok_per_s, 1e-9):.2f}x)")
    rows.append({"what": f"tool calls, {n} concurrent, distinct tool sets", **speed(calls)})
    rows.append({"what": f"same requests as text, same lengths, {n} concurrent", **speed(text_run)})
