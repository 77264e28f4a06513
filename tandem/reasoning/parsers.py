"""Reasoning formats: the markers a model family writes around its thinking, as text and as token ids.

A `ReasoningParser` is fixed by its markers and one flag:

    start            the text that opens the thinking ("<think>")
    end              the text that closes it ("</think>"), matched in the output as its token-id sequence
    implicit_ends    texts that end the thinking without `end` and belong to the answer (Qwen3: "<tool_call>")
    thinks_by_default  whether a request thinks when its prompt neither opens nor closes the block (the model
                     writes `start` itself: Qwen3, DeepSeek-R1), or answers from the first token (generic)

The starting state comes from the rendered prompt: a prompt that ends with `start` (Qwen3.5 / 3.6, DeepSeek-R1's
updated template: "<think>\\n") thinks; one that ends with `end` (an empty block: `enable_thinking=False`) answers.
Everything here is plain data built once per engine from its tokenizer; a `ThinkingState` (state.py) follows one
sequence, made by the parser (`start_state`: a `MarkerThinking` here, harmony's own for gpt-oss). Parsers are
registered by name (`register_reasoning_parser`), vLLM's names where vLLM has them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from tandem.reasoning.state import Decode, Encode, MarkerThinking, ReasoningMarkers, ThinkingState

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens decoded to tell whether it opens or closes the block


class ReasoningError(ValueError):
    """An unknown parser name or markers that this tokenizer cannot spell."""


class ReasoningParser(abc.ABC):
    """One model family's thinking format."""

    name: ClassVar[str]
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()
    thinks_by_default: bool = True

    def markers(self, encode: Encode, decode: Decode) -> ReasoningMarkers:
        """The markers as this tokenizer writes them; ReasoningError when `end` encodes to nothing."""
        end_ids = tuple(encode(self.end))
        if not end_ids:
            raise ReasoningError(f"reasoning parser {self.name!r}: the end marker {self.end!r} encodes to no token")
        implicit = tuple(tuple(encode(t)) for t in self.implicit_ends if encode(t))
        start_ids = encode(self.start) if self.start else []
        return ReasoningMarkers(self.start, self.end, end_ids, implicit, decode(end_ids),
                                decode(start_ids) if start_ids else "")

    def start_state(self, markers: ReasoningMarkers, prompt_ids: Sequence[int], budget: int | None,
                    decode: Decode) -> ThinkingState:
        """The state of a sequence about to generate after `prompt_ids`."""
        return MarkerThinking(markers, self.starts_thinking(prompt_ids, decode), budget)

    def starts_thinking(self, prompt_ids: Sequence[int], decode: Decode) -> bool:
        """Whether the first generated token is thinking, from the end of the rendered prompt."""
        tail = decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])).rstrip()
        if self.start and tail.endswith(self.start):
            return True
        if tail.endswith(self.end):
            return False
        return self.thinks_by_default


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3, Qwen3.5 and Qwen3.6 (and QwQ): `<think>...</think>`; the Qwen3.5 / 3.6 generation prompt opens the
    block itself, Qwen3's lets the model write `<think>`. A `<tool_call>` written while thinking ends the thinking:
    Qwen3 sometimes calls a tool without closing the block, and that call is the answer."""

    name = "qwen3"
    implicit_ends = ("<tool_call>",)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the template opens `<think>\\n`, so the output may hold only `</think>`."""

    name = "deepseek_r1"


class GenericReasoningParser(ReasoningParser):
    """Any model, markers given: `GenericReasoningParser(start="<reasoning>", end="</reasoning>")`. Thinks only
    when the prompt opens the block, unless `thinks_by_default`."""

    name = "generic"

    def __init__(self, start: str = "<think>", end: str = "</think>", thinks_by_default: bool = False,
                 implicit_ends: Sequence[str] = ()) -> None:
        if not end:
            raise ReasoningError("the generic reasoning parser needs an end marker")
        self.start, self.end = start, end
        self.thinks_by_default = thinks_by_default
        self.implicit_ends = tuple(implicit_ends)


_PARSERS: dict[str, Callable[..., ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "generic": GenericReasoningParser,
}


def register_reasoning_parser(name: str, factory: Callable[..., ReasoningParser]) -> None:
    """Make `name` usable as `reasoning_parser=` / `--reasoning-parser`."""
    _PARSERS[name] = factory


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def make_reasoning_parser(spec: str | Mapping[str, Any] | ReasoningParser) -> ReasoningParser:
    """A parser from its name, from {"name": ..., options} (e.g. {"name": "generic", "start": "<r>", "end": "</r>"}),
    or as given. ReasoningError for an unknown name or bad options."""
    if isinstance(spec, ReasoningParser):
        return spec
    options = dict(spec) if isinstance(spec, Mapping) else {"name": spec}
    name = options.pop("name", None)
    factory = _PARSERS.get(str(name))
    if factory is None:
        raise ReasoningError(f"unknown reasoning parser {name!r}; known: {reasoning_parser_names()}")
    try:
        return factory(**options)
    except TypeError as e:
        hint = "" if name == "generic" else " (markers are the generic parser's: --reasoning-markers alone)"
        raise ReasoningError(f"reasoning parser {name!r} does not take the options {sorted(options)}{hint}") from e
