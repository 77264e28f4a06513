"""gpt-oss's chat format, harmony, through the `openai_harmony` package: its vocabulary found offline, conversations
rendered to prompt ids (`HarmonyChatFormat`), and an output read message by message (`HarmonyReader`).

Vocabulary. openai_harmony builds its o200k_harmony encoding from `o200k_base.tiktoken`; without the environment
variable TIKTOKEN_ENCODINGS_BASE it downloads that file, with it it reads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`
and checks its sha256. tandem never lets it download: before the encoding is loaded the variable names a folder
holding the file, found in this order (`vocabulary_dir`):

    1. TIKTOKEN_ENCODINGS_BASE as the user set it (the file must be there);
    2. tandem_home()/tiktoken, when it holds the file;
    3. written there from the model's own tokenizer (ids below 199998 are o200k_base's ranks, byte for byte), kept
       only when its sha256 is harmony's;
    else a ConfigError names both places. The variable is set at call time, never at import.

Rendering (what vLLM's harmony path and gpt-oss's own template do): a system message (reasoning effort low / medium /
high, the conversation's date, no `commentary` channel when no function is offered), a developer message (the
conversation's system / developer texts as instructions, the request's functions as tools), then the turns; an
assistant turn's reasoning is an `analysis` message, its text a `final` one (a `commentary` preamble beside tool
calls), each call a `commentary` message to `functions.NAME`, a tool result a message from `functions.NAME`.
Harmony drops the analysis of turns that ended in a final answer, as the model was trained.

Reading: `HarmonyReader` follows harmony's `StreamableParser` token by token: `analysis` -> reasoning, `final` (and
preambles) -> content, a message to `functions.NAME` -> a call. Off-format tokens never raise: a token the parser
refuses starts a new assistant message (as if `<|start|>assistant` had been written), and is dropped if that fails
too; after `<|return|>`, `<|call|>` or `<|endoftext|>` nothing is read.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.config import ConfigError
from tandem.paths import tandem_home

ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_RANKS = 199998  # o200k_base's BPE ranks: ids 0 .. 199997 of o200k_harmony

# o200k_harmony's special tokens (fixed ids: the released gpt-oss tokenizer.json has them at these)
ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = (
    199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012)
ASSISTANT_ID, FINAL_ID = 173781, 17196  # "assistant", "final" (one token each)
MARKER_PIECES = {"<|return|>": RETURN, "<|constrain|>": CONSTRAIN, "<|channel|>": CHANNEL, "<|start|>": START,
                 "<|end|>": END, "<|message|>": MESSAGE, "<|call|>": CALL}
# nothing of the output follows these: an assistant action's stop tokens, and `<|endoftext|>` (an EOS id of the
# released generation_config.json, which harmony's parser would read as text)
STOPS = frozenset({RETURN, CALL, ENDOFTEXT})
EFFORTS = ("low", "medium", "high")
FUNCTIONS = "functions."
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")

Pieces = Callable[[], Mapping[str, int]]  # a byte-level BPE tokenizer's vocabulary (piece -> id)


# ------------------------------------------------------------------------------------------------- vocabulary
def vocabulary_dir(pieces: Pieces | None = None) -> Path:
    """The folder holding o200k_base.tiktoken, put in TIKTOKEN_ENCODINGS_BASE (see the module docstring);
    `pieces` lets it be written from the model's tokenizer. ConfigError when it is nowhere."""
    given = os.environ.get(ENCODINGS_ENV)
    if given:
        folder = Path(given).expanduser()
        if not (folder / VOCAB_FILE).is_file():
            raise ConfigError(f"{ENCODINGS_ENV}={given} has no {VOCAB_FILE}: gpt-oss's harmony format reads its "
                              f"vocabulary there (put the file there, or unset {ENCODINGS_ENV})")
        return folder
    folder = tandem_home() / "tiktoken"
    if not (folder / VOCAB_FILE).is_file() and (pieces is None or not write_vocabulary(pieces(), folder)):
        raise ConfigError(
            f"gpt-oss's harmony format needs {VOCAB_FILE} (o200k_base, sha256 {VOCAB_SHA256[:12]}...) and it is not "
            f"here: set {ENCODINGS_ENV} to a folder holding it, or put it in {folder}")
    os.environ[ENCODINGS_ENV] = str(folder)
    return folder


def speaks_harmony(pieces: Mapping[str, int]) -> bool:
    """Whether a vocabulary holds o200k_harmony's markers at their ids: a gpt-oss tokenizer, not a gpt-oss shape
    written with another model's tokens (the benchmarks' random-weight files)."""
    return all(pieces.get(piece) == i for piece, i in MARKER_PIECES.items())


def write_vocabulary(pieces: Mapping[str, int], folder: Path) -> bool:
    """Write o200k_base.tiktoken into `folder` from a byte-level BPE vocabulary (ids below NUM_RANKS are the ranks);
    False, writing nothing, when the result is not harmony's file byte for byte."""
    data = tiktoken_ranks(pieces)
    if data is None or hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{VOCAB_FILE}.", delete=False) as f:
        f.write(data)
    os.replace(f.name, folder / VOCAB_FILE)  # atomic: a concurrent reader sees no file or the whole file
    return True


def tiktoken_ranks(pieces: Mapping[str, int]) -> bytes | None:
    """The `.tiktoken` text ("base64(bytes) rank" per line, by rank) of ids 0 .. NUM_RANKS - 1; None when one is
    missing or is not a byte-level piece."""
    decoder = _byte_decoder()
    by_id: dict[int, str] = {i: p for p, i in pieces.items() if i < NUM_RANKS}
    if len(by_id) != NUM_RANKS:
        return None
    try:
        lines = [base64.b64encode(bytes(decoder[c] for c in by_id[i])) + b" %d\n" % i for i in range(NUM_RANKS)]
    except KeyError:
        return None
    return b"".join(lines)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def harmony_encoding(pieces: Pieces | None = None) -> Any:
    """openai_harmony's gpt-oss encoding, its vocabulary found offline (`vocabulary_dir`); loaded once per folder."""
    return _load_encoding(str(vocabulary_dir(pieces)))


@functools.cache
def _load_encoding(folder: str) -> Any:
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:  # e.g. a file of the wrong hash
        raise ConfigError(f"openai_harmony cannot load its encoding from {folder}: {e}") from e


# -------------------------------------------------------------------------------------------------- rendering
class HarmonyChatFormat:
    """Conversations rendered by openai_harmony (a `tandem.tokenizer.ChatFormat`; see the module docstring)."""

    name: str = "harmony"
    tool_call_parser: str | None = "openai"  # calls are commentary messages to functions.NAME
    # its answers are channels: without this parser, text would hold every channel's headers (vLLM reads harmony
    # whenever the model is gpt-oss, whatever --reasoning-parser says)
    reasoning_parser: str | None = "openai_gptoss"
    available: bool = True  # no template needed

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.stop_token_ids: tuple[int, ...] = tuple(encoding.stop_tokens_for_assistant_actions())
        self.call_token_ids: tuple[int, ...] = (CALL,)  # written by call_grammar's grammar

    @classmethod
    def load(cls, pieces: Pieces | None = None) -> HarmonyChatFormat:
        """The format with its encoding (ConfigError when the vocabulary is nowhere)."""
        return cls(harmony_encoding(pieces))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt ids of `messages` (OpenAI / Hugging Face chat form); kwargs: `tools` (OpenAI tool objects),
        `reasoning_effort`, `conversation_start_date` (default: today), `model_identity`; others are ignored, as a
        template ignores what it does not read. ValueError for what harmony cannot say."""
        from openai_harmony import Conversation, HarmonyError, Role

        conversation = Conversation.from_messages(harmony_messages(messages, **kwargs))
        try:
            if add_generation_prompt:
                return list(self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
            return list(self.encoding.render_conversation(conversation))
        except HarmonyError as e:
            raise ValueError(f"harmony cannot render this conversation: {e}") from e

    def render_text(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The rendered prompt as text, special tokens spelled out."""
        return str(self.encoding.decode(self.render(messages, add_generation_prompt, **kwargs)))


def harmony_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                     reasoning_effort: str | None = None, conversation_start_date: str | None = None,
                     model_identity: str | None = None, **_: Any) -> list[Any]:
    """The harmony messages of a conversation: system, developer (if it says anything), then the turns."""
    from openai_harmony import DeveloperContent, Message, Role

    functions = [_tool_description(t) for t in tools or ()]
    out = [_system_message(reasoning_effort, conversation_start_date, model_identity, bool(functions))]
    instructions = "\n\n".join(t for m in messages if m.get("role") in ("system", "developer") and (t := text_of(m)))
    if instructions or functions:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if functions:
            developer = developer.with_function_tools(functions)
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool-call id -> function name, for results that name only the call
    for m in messages:
        out += _turn(m, names)
    return out


def _system_message(effort: str | None, date: str | None, identity: str | None, with_functions: bool) -> Any:
    from openai_harmony import ChannelConfig, Message, ReasoningEffort, Role, SystemContent

    system = SystemContent.new()
    if identity:
        system = system.with_model_identity(identity)
    if effort is not None:
        if str(effort).lower() not in EFFORTS:
            raise ValueError(f"reasoning_effort {effort!r}: harmony knows {', '.join(EFFORTS)}")
        system = system.with_reasoning_effort(ReasoningEffort(str(effort).capitalize()))
    system = system.with_conversation_start_date(date or datetime.date.today().isoformat())
    if not with_functions:  # as vLLM: no commentary channel when nothing can be called
        system = system.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    return Message.from_role_and_content(Role.SYSTEM, system)


def _tool_description(tool: Mapping[str, Any]) -> Any:
    from openai_harmony import ToolDescription

    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError("a tool must be a function with a name")
    return ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters"))


def _turn(m: Mapping[str, Any], names: dict[str, str]) -> list[Any]:
    """One OpenAI message as harmony messages (system and developer texts went to the developer message)."""
    from openai_harmony import Author, Message, Role

    role = m.get("role")
    if role in ("system", "developer"):
        return []
    if role == "user":
        return [Message.from_role_and_content(Role.USER, text_of(m))]
    if role == "assistant":
        return _assistant_turn(m, names)
    if role in ("tool", "function"):
        name = m.get("name") or names.get(str(m.get("tool_call_id") or ""), "")
        if not name:
            raise ValueError("a tool result must name its function (name) or its call (tool_call_id)")
        author = Author.new(Role.TOOL, f"{FUNCTIONS}{name}")
        return [Message.from_author_and_content(author, text_of(m)).with_channel("commentary")]
    raise ValueError(f"harmony cannot render a message of role {role!r}")


def _assistant_turn(m: Mapping[str, Any], names: dict[str, str]) -> list[Any]:
    """reasoning -> analysis; text -> final (a commentary preamble beside calls); each call -> commentary to it."""
    from openai_harmony import Message, Role

    out = []
    thought = m.get("reasoning_content") or m.get("reasoning")
    if thought:
        out.append(Message.from_role_and_content(Role.ASSISTANT, str(thought)).with_channel("analysis"))
    calls, text = m.get("tool_calls") or [], text_of(m)
    if text:
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary" if calls else "final"))
    for call in calls:
        fn = call["function"]
        names[str(call.get("id") or "")] = fn["name"]
        args = fn.get("arguments")
        body = args if isinstance(args, str) else _json(args if args is not None else {})
        out.append(Message.from_role_and_content(Role.ASSISTANT, body).with_channel("commentary")
                   .with_recipient(f"{FUNCTIONS}{fn['name']}").with_content_type("json"))
    return out


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def text_of(m: Mapping[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined."""
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type", "text") == "text")


# --------------------------------------------------------------------------------------------- forced calls
JSON_WHITESPACE = "[\\x20\\x0A\\x0D\\x09]"


def call_grammar(schemas: Mapping[str, Any], max_whitespace: int) -> str:
    """An llguidance Lark grammar of a gpt-oss turn that is one call of one of `schemas` (function name -> the JSON
    schema of its arguments), from the first output token on (the prompt ends at `<|start|>assistant`):

        [<|channel|>analysis<|message|> TEXT <|end|><|start|>assistant]
        <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> ARGS <|call|>

    At most one analysis message (the thinking, free text: no special token can occur in it); the markers are the
    special tokens alone (harmony's parser reads no spelled-out marker); ARGS is JSON valid under the schema, with
    any whitespace in runs of at most `max_whitespace` characters. `<|call|>` ends the turn (a stop token), so a
    turn holds one call, as gpt-oss writes them."""
    style = {"whitespace_flexible": True, "whitespace_pattern": f"{JSON_WHITESPACE}{{0,{int(max_whitespace)}}}"}
    calls = [f'call{i}: {json.dumps(name)} " " <[{CONSTRAIN}]> "json" <[{MESSAGE}]> '
             f'%json {json.dumps({**schema, "x-guidance": style})} <[{CALL}]>'
             for i, (name, schema) in enumerate(schemas.items())]
    return "\n".join([
        "%llguidance {}",
        "start: analysis? call",
        f'analysis: <[{CHANNEL}]> "analysis" <[{MESSAGE}]> TEXT <[{END}]> <[{START}]> "assistant"',
        f'call: <[{CHANNEL}]> "commentary to=functions." ({" | ".join(f"call{i}" for i in range(len(calls)))})',
        *calls,
        r"TEXT: /(.|\n)*/",
    ]) + "\n"


# ---------------------------------------------------------------------------------------------------- reading
def header_channel(header: str) -> str | None:
    """The channel a message header names ("<|channel|>final <|constrain|>json" -> "final"), None if it names none."""
    m = _CHANNEL_RE.search(header)
    return m.group(1) if m else None


@dataclass
class HarmonyCall:
    """A message to `functions.NAME` as read so far (`done` once its `<|call|>` or `<|end|>` came)."""

    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class HarmonyReader:
    """One output's messages, token by token (see the module docstring). `prompt_tail`: the prompt from its last
    `<|start|>` on, so that the reader starts where the model does (by default: after `<|start|>assistant`)."""

    encoding: Any
    prompt_tail: Sequence[int] = ()
    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCall] = field(default_factory=list)
    answering: bool = False  # a message other than analysis began: the answer (content, calls) has started
    ended: bool = False  # a stop token was read
    _parser: Any = None
    _seen: int = 0  # messages of the parser already taken
    _kind: str | None = None  # the open message's part: "reasoning" | "content" | "call" | None (none open)
    _fresh: bool = False  # the open message has given no text yet

    def __post_init__(self) -> None:
        self._parser = self._primed(self.prompt_tail)
        self._take_open_message()

    def feed(self, token: int) -> None:
        """Read one output token."""
        if self.ended:
            return
        if token == ENDOFTEXT:
            self._close()
        else:
            self._process(int(token))
            self._take_open_message()
            delta = self._parser.last_content_delta
            if delta and self._kind is not None:
                self._append(delta)
        if len(self._parser.messages) > self._seen:  # the open message closed
            self._seen = len(self._parser.messages)
            if self._kind == "call":
                self.calls[-1].done = True
            self._kind = None
        self.ended = token in STOPS

    def _close(self) -> None:
        """The output ends without a stop token of harmony's: the open message closes as it stands."""
        from openai_harmony import HarmonyError

        with contextlib.suppress(HarmonyError):
            self._parser.process_eos()

    def _primed(self, tail: Sequence[int]) -> Any:
        """A parser in the model's starting state (after the prompt's tail), or one after `<|start|>assistant`."""
        from openai_harmony import HarmonyError, Role, StreamableParser

        if tail and tail[0] == START:
            parser = StreamableParser(self.encoding, role=None)
            try:
                for t in tail:
                    parser.process(int(t))
                return parser
            except HarmonyError:
                pass
        return StreamableParser(self.encoding, role=Role.ASSISTANT)

    def _process(self, token: int) -> None:
        from openai_harmony import HarmonyError, Role, StreamableParser

        try:
            self._parser.process(token)
            return
        except HarmonyError:
            pass
        self._parser, self._seen, self._kind = StreamableParser(self.encoding, role=Role.ASSISTANT), 0, None
        try:
            self._parser.process(token)
        except HarmonyError:  # not even a header's token: dropped, the next starts a message again
            self._parser = StreamableParser(self.encoding, role=Role.ASSISTANT)

    def _take_open_message(self) -> None:
        """Classify a message whose body just began (its header is complete)."""
        from openai_harmony import StreamState

        if self._kind is not None or self._parser.state != StreamState.CONTENT:
            return
        channel, recipient = self._parser.current_channel, self._parser.current_recipient or ""
        if recipient.startswith(FUNCTIONS):
            self._kind = "call"
            self.calls.append(HarmonyCall(recipient[len(FUNCTIONS):]))
        elif channel == "analysis" or (channel != "final" and recipient and not recipient.startswith("<|")):
            self._kind = "reasoning"  # analysis, and built-in tools' calls (python, browser), as vLLM shows them
        else:
            self._kind = "content"  # final (its recipient may hold a "<|constrain|>" type), preambles, no channel
        self._fresh = True
        self.answering = self.answering or self._kind != "reasoning"

    def _append(self, delta: str) -> None:
        """Add a body's text to its part; two messages of one part are joined by a line break."""
        if self._kind == "call":
            self.calls[-1].arguments += delta
            return
        sep = "\n" if self._fresh else ""
        self._fresh = False
        if self._kind == "reasoning":
            self.reasoning += sep + delta if self.reasoning else delta
        else:
            self.content += sep + delta if self.content else delta
