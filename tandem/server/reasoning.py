"""Reasoning models over HTTP (`--reasoning-parser`): the request controls of the thinking, and how it is shown.

The engine core splits each completion itself (`CompletionDelta.reasoning` / `.content`, the thinking's markers
left out; tandem/reasoning); the server only chooses what the client sees, with vLLM's names:

    requests    `chat_template_kwargs` over --default-chat-template-kwargs (setting one of `enable_thinking` /
                `thinking` sets both, as SGLang does), `reasoning_effort` (every value reaches the template as
                `reasoning_effort`; "none" also turns the thinking off), `thinking_token_budget` (else
                --thinking-token-budget), `include_reasoning` (false: no thinking in the answer); an assistant
                turn of the history keeps its `reasoning` / `reasoning_content`, under both names (Qwen3's template
                reads `reasoning_content`), whatever form the tool machinery gives the messages.
    answers     `content` is the text after the thinking (null when the thinking never ended); the thinking goes in
                `reasoning` and `reasoning_content`; tool calls are parsed from the content alone; usage has
                `completion_tokens_details.reasoning_tokens`. Streamed, a delta's thinking goes out as its own chunk
                before its answer's, so every reasoning chunk of a choice precedes its first content chunk.

Without a parser nothing here changes a response: no reasoning keys, no token details.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.params import SamplingParams
from tandem.server.engine_client import CompletionDelta
from tandem.server.protocol import APIError, CompletionTokensDetails

THINKING_SWITCHES = ("enable_thinking", "thinking")  # the templates' names for the same switch
# the chat-template call's own arguments (and `tools`, which come from the request's tools): a request may not set
# them through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
    "chat_template", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_template_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """ValueError naming the keys of `kwargs` that the chat-template call sets itself."""
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if bad:
        raise ValueError(f"{where} may not set {', '.join(bad)}")


def template_kwargs(defaults: Mapping[str, Any] | None, requested: Mapping[str, Any] | None,
                    effort: str | None) -> dict[str, Any]:
    """The chat template's extra keyword arguments: the server's defaults, then what `reasoning_effort` implies, then
    the request's own; a layer that sets one thinking switch sets both. APIError (400) for a reserved key."""
    try:
        check_template_kwargs(requested or {}, "chat_template_kwargs")
    except ValueError as e:
        raise APIError(str(e), param="chat_template_kwargs") from e
    implied: dict[str, Any] = {}
    if effort is not None:
        implied = {"reasoning_effort": effort, **(dict.fromkeys(THINKING_SWITCHES, False) if effort == "none" else {})}
    out: dict[str, Any] = {}
    for layer in (defaults or {}, implied, requested or {}):
        out.update(layer)
        given = [k for k in THINKING_SWITCHES if k in layer]
        if len(given) == 1:
            out.update(dict.fromkeys(THINKING_SWITCHES, layer[given[0]]))
    return out


def with_thinking_budget(params: SamplingParams, parser: str | None, default: int | None) -> SamplingParams:
    """`params` with the server's thinking budget when the request gave none (only with a reasoning parser), unless
    its grammar holds the thinking too (gpt-oss's forced tool calls), which a forced end would break."""
    so = params.structured_outputs
    if parser is None or default is None or params.thinking_token_budget is not None or (so is not None and so.enable_in_reasoning):
        return params
    return params.clone(thinking_token_budget=default)


def keep_history_reasoning(converted: list[dict[str, Any]], messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`converted` (the messages in the form the template takes: the tool machinery rebuilds them) with each
    assistant turn's thinking back from `messages`, under both names. The conversions keep the assistant turns, one
    for one and in order; if they did not, nothing is added."""
    sources = [m for m in messages if m.get("role") == "assistant"]
    targets = [m for m in converted if m.get("role") == "assistant"]
    if len(sources) != len(targets):
        return converted
    for source, target in zip(sources, targets):
        if source.get("reasoning_content") is not None:
            target["reasoning"] = target["reasoning_content"] = source["reasoning_content"]
    return converted


def token_details(parser: str | None, reasoning_tokens: int) -> CompletionTokensDetails | None:
    """usage.completion_tokens_details: the thinking's tokens (end marker included), with a parser only."""
    return CompletionTokensDetails(reasoning_tokens=reasoning_tokens) if parser is not None else None


@dataclass
class Thought:
    """One completion's thinking and answer, accumulated from its deltas."""

    reasoning: str = ""
    content: str = ""
    num_tokens: int = 0  # the thinking's tokens (the engine's running count)
    answering: bool = False  # the answer has begun (content is not null)

    def add(self, c: CompletionDelta) -> None:
        self.reasoning += c.reasoning
        self.content += c.content
        self.num_tokens = max(self.num_tokens, c.num_reasoning_tokens)
        self.answering = self.answering or c.answering

    def answer(self) -> str | None:
        """The answer, or None when the thinking never ended."""
        return self.content if self.answering else None


class ChatReasoning:
    """How one chat (or Responses) request shows reasoning: `on` with a reasoning parser, `shown` unless the request
    said include_reasoning=false."""

    def __init__(self, parser: str | None, include: bool = True) -> None:
        self.on = parser is not None
        self.shown = self.on and include

    def answer(self, text: str, thought: Thought) -> str | None:
        """A finished completion's answer: all of `text` without a parser."""
        return thought.answer() if self.on else text

    def shown_reasoning(self, thought: Thought) -> str | None:
        """A finished completion's thinking as the message shows it (under `reasoning` and `reasoning_content`)."""
        return (thought.reasoning or None) if self.shown else None

    def split(self, c: CompletionDelta) -> tuple[str | None, str]:
        """A delta as (the thinking to send in a chunk of its own, or None; its answer text: all of it without a
        parser)."""
        if not self.on:
            return None, c.text
        return (c.reasoning or None) if self.shown else None, c.content
