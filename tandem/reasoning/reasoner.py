"""`Reasoner`: a reasoning parser bound to one tokenizer, the one object the engine holds for it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.reasoning.parsers import ReasoningParser, make_reasoning_parser
from tandem.reasoning.state import ThinkingState
from tandem.tokenizer import Tokenizer


class Reasoner:
    """Builds each sequence's `ThinkingState` from its rendered prompt; decodes for the budget's UTF-8 check."""

    def __init__(self, parser: str | Mapping[str, Any] | ReasoningParser, tokenizer: Tokenizer) -> None:
        self.parser = make_reasoning_parser(parser)
        self._tokenizer = tokenizer
        self.markers = self.parser.markers(self._encode, self.decode)

    @property
    def name(self) -> str:
        return self.parser.name

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def start(self, prompt_ids: Sequence[int], budget: int | None) -> ThinkingState:
        """The state of a sequence about to generate after `prompt_ids`."""
        return self.parser.start_state(self.markers, prompt_ids, budget, self.decode)
