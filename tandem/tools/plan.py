"""Tool calling for one request: (tools, tool_choice, parallel_tool_calls) -> a prompt and a grammar.

`ToolPlan.build` turns a request's tools into:
- the conversation to template: with a template that knows tools, messages in the Hugging Face tool format and
  `tools=` for the template; with one that does not (the demo model's), the documented fallback format below;
- a structural tag (StructuredOutputsParams(structural_tag=...)) that constrains every call's arguments to its
  function's JSON schema, compiled on the CPU like any grammar and overlapped with the forward:
      named f     the whole output is one call of f
      "required"  only calls, at least one, of the offered functions (one grammar over their union); several,
                  separated by the format's separator, when parallel_tool_calls allows
      "auto"      free text until the format's trigger, then a call held to the schema of the function it names
                  (a trigger-activated grammar), so an auto-mode call always parses and validates too
      "none"      no grammar, no parsing: tools are shown to the model but the answer is text
- the ToolParser that reads the calls back.
gpt-oss's harmony (`openai`) is the exception: its "required" / named calls are forced by its own grammar over the whole
turn, analysis channel included (`ToolParser.call_grammar`, tools/harmony.py), and its "auto" has no grammar.

Arguments are JSON with any whitespace in runs of at most MAX_JSON_WHITESPACE characters (both backends).
Schemas are closed before compiling: an object schema that lists `properties` and says nothing about
`additionalProperties` gets `additionalProperties: false` (OpenAI's strict mode does the same), because a call's
arguments become keyword arguments and an invented key fails the function. Objects directly under `allOf` are left
open (closing them would make the conjunction unsatisfiable). Neither backend implements `uniqueItems`: an array of
distinct values of a small enum (<= MAX_UNIQUE_ENUM values) becomes the enum of its subsequences, other arrays lose
the keyword. The model is shown the schema as the client wrote it.

Fallback format (templates without tools): a system message lists the functions as JSON inside <tools></tools>
and asks for calls as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (Hermes), earlier calls are
written back in that format into the assistant turn, and tool results come back as user turns
`<tool_response>\\n...\\n</tool_response>`. See docs/tool_calling.md.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.tools.parsers import (
    HermesToolParser,
    ToolParser,
    arguments_object,
    make_parser,
    parser_for_template,
)

# Arguments take any JSON whitespace, in runs of at most this many characters: a line break and an indent fit, a
# model that loops on whitespace (small ones do, under a grammar that allows it anywhere) cannot.
MAX_JSON_WHITESPACE = 4
# uniqueItems over an enum of at most this many values is spelled out (2**8 = 256 subsequences at most).
MAX_UNIQUE_ENUM = 8
XGRAMMAR_IGNORES = ("not", "if", "contains", "dependentRequired", "dependentSchemas", "uniqueItems")
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
CHOICES = ("none", "auto", "required")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

FALLBACK_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to help with the user query. "
    "Do not make assumptions about what values to plug into functions. The functions you may call are given as "
    "JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolError(ValueError):
    """A request's tools or tool_choice are invalid (400); `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    """One function offered to the model: its name, description, the JSON schema of its arguments as the client
    wrote it (what the model is shown) and the copy the grammar compiles (`grammar_schema`)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    grammar: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI tool object (what chat templates and the fallback prompt show)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[FunctionTool]:
    """OpenAI `tools` (type "function") -> FunctionTools; ToolError on a bad name, schema or duplicate."""
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        name = fn.get("name")
        if tool.get("type", "function") != "function" or not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolError(f"tools[{i}] must be a function with a name of 1-64 letters, digits, '_', '.' or '-'",
                            f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        if any(t.name == name for t in out):
            raise ToolError(f"two tools are named {name!r}", f"tools[{i}].function.name")
        out.append(FunctionTool(name, fn.get("description"), params, grammar_schema(params)))
    return out


def grammar_schema(schema: Any, under_all_of: bool = False) -> Any:
    """The copy of `schema` the grammar compiles (see the module doc): object schemas with `properties` closed,
    `uniqueItems` arrays of a small enum spelled out (_unique_enum_array), other `uniqueItems` dropped."""
    if isinstance(schema, list):
        return [grammar_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _grammar_child(k, v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not under_all_of and "patternProperties" not in out:
        out["additionalProperties"] = False
    if out.pop("uniqueItems", False) is True:
        return _unique_enum_array(out)
    return out


def xgrammar_gaps(schema: Any) -> list[str]:
    """The keywords of a (grammar) schema that xgrammar ignores rather than enforces: `multipleOf` outside integers,
    `not`, `if`, `contains`, `dependentRequired`, `dependentSchemas`, `uniqueItems` (llguidance enforces all but the
    last, which grammar_schema spells out or drops)."""
    found: list[str] = []
    if isinstance(schema, list):
        for s in schema:
            found += xgrammar_gaps(s)
    elif isinstance(schema, dict):
        found += [k for k in XGRAMMAR_IGNORES if k in schema]
        if "multipleOf" in schema and schema.get("type") != "integer":
            found.append("multipleOf")
        for key, value in schema.items():
            if key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
                found += xgrammar_gaps(value)
    return found


def _grammar_child(key: str, value: Any) -> Any:
    if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
        return {name: grammar_schema(s) for name, s in value.items()}
    if key == "allOf" and isinstance(value, list):
        return [grammar_schema(s, under_all_of=True) for s in value]
    if key in ("items", "additionalProperties", "anyOf", "oneOf", "not", "prefixItems", "contains", "if", "then", "else"):
        return grammar_schema(value)
    return copy.deepcopy(value)


def _unique_enum_array(schema: dict[str, Any]) -> dict[str, Any]:
    """An array of distinct values of a small enum as an enum of its subsequences (in the enum's order, within
    minItems / maxItems): neither backend implements uniqueItems, and this keeps such calls valid. Any other array
    is returned without the keyword (its items may repeat)."""
    items = schema.get("items")
    if not isinstance(items, dict) or set(items) - {"type", "enum", "description", "title"} or schema.get("prefixItems"):
        return schema
    values = items.get("enum")
    if not isinstance(values, list) or not values or len(values) > MAX_UNIQUE_ENUM or len(set(map(json.dumps, values))) < len(values):
        return schema
    lo, hi = schema.get("minItems", 0), schema.get("maxItems", len(values))
    subsets = [list(c) for r in range(lo, min(hi, len(values)) + 1) for c in itertools.combinations(values, r)]
    rest = {k: v for k, v in schema.items() if k not in ("type", "items", "minItems", "maxItems")}
    return {**rest, "enum": subsets}


def choose_parser(flag: str, chat_template: str | None, format_parser: str | None = None) -> tuple[ToolParser, bool]:
    """(the parser, whether the chat format renders tools itself): `flag` 'auto' reads the format off the template;
    a template that never mentions `tools` gets the fallback format (Hermes) whatever the flag says. A chat format
    that fixes its call format (`format_parser`: harmony's "openai") renders tools itself and is 'auto''s pick."""
    if format_parser is not None:
        return make_parser(format_parser if flag == "auto" else flag), True
    native = bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None
    if flag != "auto":
        return make_parser(flag), native
    found = parser_for_template(chat_template) if native else None
    return (make_parser(found) if found else HermesToolParser()), native


@dataclass
class ToolPlan:
    """What one request's tools turn into; built by `ToolPlan.build`."""

    tools: list[FunctionTool]
    choice: str  # 'none' | 'auto' | 'required' | a function name
    parallel: bool
    parser: ToolParser
    native: bool

    @classmethod
    def build(
        cls, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel: bool | None, parser: ToolParser, native: bool
    ) -> ToolPlan | None:
        """The plan of a request, or None when it offers no tools (and names no tool choice). Raises ToolError."""
        choice = _choice_name(tool_choice)
        if not tools:
            if choice in (None, "none", "auto"):
                return None
            raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        fns = function_tools(tools)
        choice = choice or "auto"
        if choice not in CHOICES and all(f.name != choice for f in fns):
            raise ToolError(f"tool_choice names {choice!r}, which is not among the tools", "tool_choice")
        if not (parser.guided or parser.own_call_grammar) and choice not in ("none", "auto"):
            raise ToolError(f"tool_choice {choice!r} needs a grammar that forces the call; the {parser.name!r} "
                            'tool-call format has none here: use "auto"', "tool_choice")
        return cls(fns, choice, parallel is not False, parser, native)

    @property
    def constrained(self) -> bool:
        """Calls are read from the output (and, with a guided parser, held to their schemas)."""
        return self.choice != "none"

    @property
    def forced_by_own_grammar(self) -> bool:
        """Calls are forced ("required" or named) by the format's own grammar (harmony's), not a structural tag."""
        return self.parser.own_call_grammar and self.choice not in ("none", "auto")

    def structural_tag(self, answer_schema: Any = None) -> dict[str, Any] | None:
        """The grammar of the answer (xgrammar's structural-tag JSON), None for 'none'. `answer_schema` (a JSON
        response_format with tool_choice "auto") makes the answer either that JSON or calls, as OpenAI does."""
        if self.choice == "none" or not self.parser.guided:
            return None
        fns = [f for f in self.tools if f.name == self.choice] or self.tools
        tags = [{"type": "tag", "begin": self.parser.begin(f.name), "end": self.parser.end, "content": _json_format(f.grammar)}
                for f in fns]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.parser.separator, "at_least_one": True,
                 "stop_after_first": not self.parallel or self.choice not in CHOICES}
        if self.choice != "auto":
            return {"type": "structural_tag", "format": calls}
        if answer_schema is not None:
            return {"type": "structural_tag", "format": {"type": "or", "elements": [_json_format(answer_schema), calls]}}
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.parser.trigger], "tags": tags,
                                                     "at_least_one": False, "stop_after_first": not self.parallel}}

    def structured_outputs(self, backend: str | None = None, answer_schema: Any = None) -> StructuredOutputsParams | None:
        """The grammar as params. A backend left to choose (None, "auto") is pinned to llguidance when a schema uses
        a keyword xgrammar ignores (`xgrammar_gaps`): `auto` could promote the grammar to xgrammar otherwise."""
        if self.forced_by_own_grammar:
            return self._own_grammar(backend)
        tag = self.structural_tag(answer_schema)
        if tag is None:
            return None
        if backend in (None, "auto") and any(xgrammar_gaps(f.grammar) for f in self.tools):
            backend = "llguidance"
        # the answer's grammar: it starts where the thinking ends, even under an engine-wide enable_in_reasoning (from
        # the first token it would force a call with no thinking, and no end marker to split the answer at)
        return StructuredOutputsParams(structural_tag=tag, backend=backend, enable_in_reasoning=False)

    def _own_grammar(self, backend: str | None) -> StructuredOutputsParams:
        """The format's own grammar of the forced calls (llguidance Lark over the whole output, the thinking too)."""
        if backend not in (None, "auto", "llguidance"):
            raise ToolError(f"the {self.parser.name!r} tool-call format forces calls with an llguidance grammar; the "
                            f"{backend!r} backend cannot hold one", "tool_choice")
        fns = [f for f in self.tools if f.name == self.choice] or self.tools
        lark = self.parser.call_grammar({f.name: f.grammar for f in fns}, MAX_JSON_WHITESPACE)
        return StructuredOutputsParams(grammar=lark, backend="llguidance", enable_in_reasoning=True)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the plan's grammar and the special-token setting its parser needs. A forced call is the whole
        answer, so with "required" or a named function the params' own constraint (a response_format) gives way; with
        "auto" a JSON one stays the format of a text answer. The backend the params named is kept. ToolError for
        "auto" beside a constraint that is not JSON. Harmony's "auto" has no grammar and leaves `params` as they are
        (a response format then holds the final answer alone); its forced calls hold the thinking too, so a thinking
        budget, whose forced end would leave that grammar, is a ToolError."""
        if not self.constrained or not (self.parser.guided or self.forced_by_own_grammar):
            return params
        if self.forced_by_own_grammar and params.thinking_token_budget is not None:
            raise ToolError(f"tool_choice {self.choice!r} with the {self.parser.name!r} format holds the thinking to a "
                            "grammar too: thinking_token_budget cannot force its end", "thinking_token_budget")
        so = params.structured_outputs
        answer: Any = None
        if so is not None and self.choice == "auto":
            if so.kind not in ("json", "json_object"):
                raise ToolError(f'tool_choice "auto" combines only with a JSON response format, not {so.kind!r}',
                                "tool_choice")
            answer = json.loads(so.json) if so.json is not None else {"type": "object"}
        backend = so.backend if so is not None else None
        return params.clone(structured_outputs=self.structured_outputs(backend, answer),
                            skip_special_tokens=params.skip_special_tokens and self.parser.skip_special_tokens)

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the chat template (`tools` when it renders them itself)."""
        return {"tools": [f.as_openai() for f in self.tools]} if self.native else {}

    def conversation(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages to template: HF tool format for a tools-aware template, the fallback format otherwise."""
        if self.native:
            return hf_messages(messages)
        return fallback_messages(messages, self.parser, FALLBACK_SYSTEM.format(
            tools="\n".join(json.dumps(f.as_openai()["function"]) for f in self.tools)))


def _json_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _choice_name(tool_choice: Any) -> str | None:
    """'none' | 'auto' | 'required' | a function name | None, from the OpenAI field's forms."""
    if tool_choice is None or isinstance(tool_choice, str):
        if tool_choice is not None and tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {list(CHOICES)} or a named function", "tool_choice")
        return tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                    "tool_choice")


def hf_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> the Hugging Face chat-template form: text content, `developer` as `system`, each
    assistant tool call's arguments as a dict, tool results with their `tool_call_id` (and the function's name)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_hf_call(c) for c in m["tool_calls"]]
            names.update({c.get("id", ""): c["function"]["name"] for c in m["tool_calls"]})
        if role in ("tool", "function"):
            msg["role"] = "tool"
            msg["tool_call_id"] = m.get("tool_call_id")
            msg["name"] = m.get("name") or names.get(m.get("tool_call_id") or "", "")
        out.append(msg)
    return out


def _hf_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args: Any = arguments_object(fn.get("arguments") or "")
    except ValueError:
        args = fn.get("arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], parser: ToolParser, tools_prompt: str | None
) -> list[dict[str, Any]]:
    """The conversation in the fallback format (text-only roles system / user / assistant); `tools_prompt` (the
    functions on offer) joins the system message, or becomes one."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role in ("system", "developer"):
            out.append({"role": "system", "content": content})
        elif role in ("tool", "function"):
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            calls = [parser.render_call(c["function"]["name"], c["function"].get("arguments") or "{}") for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            out.append({"role": role, "content": content})
    if tools_prompt is None:
        return out
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools_prompt}"}
    else:
        out.insert(0, {"role": "system", "content": tools_prompt})
    return out
