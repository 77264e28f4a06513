"""Tool-call formats: how a model writes a call, and how its text becomes OpenAI `tool_calls` (whole or streamed).

One `ToolParser` base, one subclass per format. A format is fixed by four strings and a pattern:

    trigger     the text that starts a call ("<tool_call>")                          -> the auto-mode grammar's trigger
    begin(name) the text from the trigger up to the arguments, with the name in it  -> the grammar forces it
    end         the text after the arguments ("}\\n</tool_call>")
    separator   between two calls of one turn
    head        a regex matching a begin with any whitespace, capturing the name    -> the parser reads it back

The arguments are one JSON object; where it ends is found by scanning its brackets and strings, so a streamed call
gives its id and name as soon as the begin is complete and its arguments piece by piece, exactly as generated.
Parsing whole outputs runs the same stream parser over the whole text, so streamed and unstreamed answers agree.

Formats: Hermes / Qwen 2.5+ (`<tool_call>{"name", "arguments"}</tool_call>`, also the fallback format of
templates that know no tools), Llama 3.x JSON (`{"name", "parameters"}`, calls separated by "; "), Mistral
(`[TOOL_CALLS][{"name", "arguments"}]`; parallel calls as further items or further [TOOL_CALLS] blocks), and gpt-oss's
harmony (`openai`, vLLM's name): a call is a message to `functions.NAME`, read from the output's token ids by
harmony's own parser (tools/harmony.py), not from its text. No structural tag gives its "auto" calls (`guided`
False: a trigger inside free text cannot follow harmony's channels); "required" and a named function are forced by a
grammar of its own over the whole turn, the analysis channel too (`call_grammar`).

A parser's `stream()` is a `CallStream`: fed each delta's text and token ids, it returns the content and keeps the
call pieces; the text formats read the text (`ToolCallStream`), harmony the ids (`HarmonyCallStream`).
"""

from __future__ import annotations

import abc
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first piece of each call has `id` and `name`; later ones only `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedOutput:
    """A whole output split into the text around the calls (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser(abc.ABC):
    """A tool-call format: the strings the grammar forces, and the parser of the text that results."""

    name: ClassVar[str]
    trigger: ClassVar[str]
    end: ClassVar[str]
    separator: ClassVar[str]
    head: ClassVar[re.Pattern[str]]  # a call's begin at the cursor; group 1 is the function name
    next_head: ClassVar[re.Pattern[str] | None] = None  # a further call inside the same block (Mistral's list)
    skip_special_tokens: ClassVar[bool] = True  # False where the trigger is a special token of the vocabulary
    guided: ClassVar[bool] = True  # a grammar (structural tag) can force its calls (ToolPlan)
    own_call_grammar: ClassVar[bool] = False  # "required" / named calls are forced by `call_grammar`, not a tag

    @abc.abstractmethod
    def begin(self, name: str) -> str:
        """The exact text from the trigger to the arguments of a call of `name`."""

    def call_grammar(self, schemas: Mapping[str, Any], max_whitespace: int) -> str | None:
        """With `own_call_grammar`: an llguidance Lark grammar of an output that is one call of one of `schemas`
        (function name -> its arguments' JSON schema), from the first output token on, the thinking too; None for
        a format whose calls the structural tag of `begin` / `end` forces."""
        return None

    def render_call(self, name: str, arguments: str) -> str:
        """A call as the model writes it (used to put earlier calls back into a prompt)."""
        return f"{self.begin(name)}{arguments}{self.end}"

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str, token_ids: Sequence[int] = ()) -> ParsedOutput:
        """The calls in a whole output (its answer text and its token ids), and its content: the text formats give
        the text before the first call. The same stream parser as `stream()`, so both agree."""
        stream = self.stream()
        content = stream.feed(text, token_ids) + stream.finish()
        calls = stream.calls()
        if calls and not content.strip():
            return ParsedOutput(None, calls)
        return ParsedOutput(content or None, calls) if calls else ParsedOutput(text, [])

    def stream(self) -> CallStream:
        """An incremental parser for one streamed output."""
        return ToolCallStream(self)


_JSON_HEAD = r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"%s"\s*:\s*'


class HermesToolParser(ToolParser):
    """Hermes / Qwen 2.5+: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    trigger = "<tool_call>"
    end = "}\n</tool_call>"
    separator = "\n"
    head = re.compile(re.escape(trigger) + _JSON_HEAD % "arguments")

    def begin(self, name: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": '


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: `{"name": "f", "parameters": {...}}`, calls separated by "; " (an optional
    <|python_tag|> before the first is skipped)."""

    name = "llama3_json"
    trigger = '{"name": '
    end = "}"
    separator = "; "
    head = re.compile(r"(?:<\|python_tag\|>)?" + _JSON_HEAD % "(?:parameters|arguments)")

    def begin(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}]`; a list of several calls is read too. Its trigger
    is a special token in Mistral's vocabularies, so requests with tools keep special tokens in the text."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    end = "}]"
    separator = ""
    head = re.compile(re.escape(trigger) + r"\s*\[" + _JSON_HEAD % "arguments")
    next_head = re.compile(r"\}\s*," + _JSON_HEAD % "arguments")
    skip_special_tokens = False

    def begin(self, name: str) -> str:
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": '

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))  # Mistral's templates require 9 alphanumerics


class OpenAIToolParser(ToolParser):
    """gpt-oss (harmony): `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`, read from
    the token ids by harmony's parser (its vocabulary from tools/harmony.py, loaded on the first stream)."""

    name = "openai"
    trigger = "<|channel|>commentary to=functions."
    end = "<|call|>"
    separator = ""
    head = re.compile(r"<\|channel\|>commentary to=functions\.([A-Za-z0-9_.\-]+)\s*(?:<\|constrain\|>)?\s*\w*<\|message\|>")
    guided = False
    own_call_grammar = True

    def begin(self, name: str) -> str:
        return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"

    def call_grammar(self, schemas: Mapping[str, Any], max_whitespace: int) -> str:
        from tandem.tools.harmony import call_grammar

        return call_grammar(schemas, max_whitespace)

    def stream(self) -> CallStream:
        from tandem.tools.harmony import HarmonyReader, harmony_encoding

        return HarmonyCallStream(self, HarmonyReader(harmony_encoding()))


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, OpenAIToolParser)}


def make_parser(name: str) -> ToolParser:
    """The parser registered as `name` (ValueError naming the known ones)."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return cls()


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template writes calls in, judged from its text; None when it shows no tool-call format."""
    if not template:
        return None
    if "<|channel|>" in template:  # gpt-oss's own template writes harmony
        return "openai"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"
    return None


class _JsonExtent:
    """Finds where one JSON value ends, fed a character at a time (brackets outside strings, escapes)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, ch: str) -> bool:
        """Take one character; True when it closed the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
            self.started = True
        elif ch in "}]":
            self.depth -= 1
        return self.started and self.depth == 0


class CallStream(abc.ABC):
    """One output's calls, read delta by delta."""

    @abc.abstractmethod
    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> str:
        """Add a delta (its answer text and its token ids); returns the content text that is now certain. Call
        pieces go to `take_deltas()`."""

    @abc.abstractmethod
    def finish(self) -> str:
        """The output ended: the content text held back until now."""

    @abc.abstractmethod
    def take_deltas(self) -> list[ToolCallDelta]:
        """The call pieces recorded since the last take."""

    @abc.abstractmethod
    def calls(self) -> list[ToolCall]:
        """The complete calls so far (a call cut off by the end of the output is not among them)."""


class ToolCallStream(CallStream):
    """Incremental parser of one output's text: `feed(delta)` returns the new content text and records call pieces.

    States: before the first call (content; a tail that could start the trigger is held back), at a call's head
    (waiting until the begin is complete), inside its arguments (each character passed on as it arrives), after
    a call (text up to the next head is dropped: content is what comes before the first call).
    """

    _HEAD_WAIT = 256  # characters a head may take before the text is judged not to be a call

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0
        self.state = "content"
        self.deltas: list[ToolCallDelta] = []
        self._calls: list[ToolCall] = []
        self._args = ""
        self._extent = _JsonExtent()

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> str:
        """Add `delta` (its ids are not read); returns the content text that is now certain."""
        self.text += delta
        out = []
        while True:
            step = getattr(self, f"_at_{self.state}")()
            if step is None:
                break
            out.append(step)
        return "".join(out)

    def finish(self) -> str:
        """The output ended: held-back text that did not become a call is content."""
        if self.state in ("content", "head") and not self._calls:
            rest, self.pos = self.text[self.pos :], len(self.text)
            self.state = "done"
            return rest
        return ""

    def take_deltas(self) -> list[ToolCallDelta]:
        out, self.deltas = self.deltas, []
        return out

    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _at_content(self) -> str | None:
        start = self.text.find(self.parser.trigger, self.pos)
        if start < 0:
            safe = len(self.text) - _held_back(self.text, self.pos, self.parser.trigger)
            piece, self.pos = self.text[self.pos : safe], max(self.pos, safe)
            return piece or None
        piece, self.pos, self.state = self.text[self.pos : start], start, "head"
        return piece

    def _at_head(self) -> str | None:
        m = self.parser.head.match(self.text, self.pos)
        if m is None or m.end() == len(self.text):  # incomplete (whitespace may still grow): wait for more
            if len(self.text) - self.pos > self._HEAD_WAIT and m is None:
                self.state = "content" if not self._calls else "after"
                self.pos += len(self.parser.trigger)
                return "" if self._calls else self.text[self.pos - len(self.parser.trigger) : self.pos]
            return None
        self._open_call(m.group(1), m.end())
        return ""

    def _open_call(self, name: str, at: int) -> None:
        call_id = self.parser.new_call_id()
        self.deltas.append(ToolCallDelta(len(self._calls), call_id, name, ""))
        self._pending = (call_id, name)
        self.pos, self.state, self._args, self._extent = at, "args", "", _JsonExtent()

    def _at_args(self) -> str | None:
        if self.pos >= len(self.text):
            return None
        start = self.pos
        closed = False
        while self.pos < len(self.text) and not closed:
            closed = self._extent.feed(self.text[self.pos])
            self.pos += 1
        piece = self.text[start : self.pos]
        self._args += piece
        self.deltas.append(ToolCallDelta(len(self._calls), arguments=piece))
        if closed:
            call_id, name = self._pending
            self._calls.append(ToolCall(call_id, name, self._args))
            self.state = "after"
        return ""

    def _at_after(self) -> str | None:
        nxt = self.parser.next_head
        m = nxt.match(self.text, self.pos) if nxt is not None else None
        if m is not None and m.end() < len(self.text):
            self._open_call(m.group(1), m.end())
            return ""
        start = self.text.find(self.parser.trigger, self.pos)
        if start < 0:
            return None
        self.pos, self.state = start, "head"
        return ""

    def _at_done(self) -> str | None:
        return None


class HarmonyCallStream(CallStream):
    """Calls read from harmony token ids (messages to functions.NAME); the content is the answer text as given (the
    engine's harmony split already holds only the final and preamble text)."""

    def __init__(self, parser: ToolParser, reader: Any) -> None:
        self.parser = parser
        self.reader = reader  # a tools/harmony.py HarmonyReader, fed every token of the output
        self.deltas: list[ToolCallDelta] = []
        self._ids: list[str] = []  # each call's id, by index
        self._sent: list[int] = []  # argument characters sent per call

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> str:
        for token in token_ids:
            self.reader.feed(token)
        for i, call in enumerate(self.reader.calls):
            if i == len(self._ids):
                self._ids.append(self.parser.new_call_id())
                self._sent.append(0)
                self.deltas.append(ToolCallDelta(i, self._ids[i], call.name, ""))
            if len(call.arguments) > self._sent[i]:
                self.deltas.append(ToolCallDelta(i, arguments=call.arguments[self._sent[i]:]))
                self._sent[i] = len(call.arguments)
        return delta

    def finish(self) -> str:
        return ""

    def take_deltas(self) -> list[ToolCallDelta]:
        out, self.deltas = self.deltas, []
        return out

    def calls(self) -> list[ToolCall]:
        return [ToolCall(self._ids[i], c.name, c.arguments) for i, c in enumerate(self.reader.calls)
                if c.done and i < len(self._ids)]


def _held_back(text: str, pos: int, trigger: str) -> int:
    """How many trailing characters of text[pos:] could be the start of `trigger`."""
    for n in range(min(len(trigger) - 1, len(text) - pos), 0, -1):
        if trigger.startswith(text[len(text) - n :]):
            return n
    return 0


def arguments_object(arguments: str) -> dict[str, object]:
    """A call's arguments text as a dict (what chat templates expect); ValueError when it is not a JSON object."""
    value = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(value, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return value
