"""Reasoning models: the thinking part of an output kept apart, and structured outputs applied only after it.

parsers.py (each family's markers and its starting state from the rendered prompt, by name), state.py (one
sequence's thinking token by token: where it ends, the thinking budget, the text split), harmony.py (gpt-oss: the
thinking read off harmony's channels, `openai_gptoss`), reasoner.py (a parser bound to a tokenizer: what the engine
holds). The engine (engine/thinking.py) calls these; the server's chat-side controls
(template kwargs, `reasoning_effort`, history, the response fields) are in server/reasoning.py. Nothing here runs a
model or imports the server.
"""

from __future__ import annotations

from tandem.reasoning.harmony import GptOssReasoningParser, HarmonyThinking
from tandem.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    GenericReasoningParser,
    Qwen3ReasoningParser,
    ReasoningError,
    ReasoningMarkers,
    ReasoningParser,
    make_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from tandem.reasoning.reasoner import Reasoner
from tandem.reasoning.state import MarkerThinking, ThinkingState

register_reasoning_parser(GptOssReasoningParser.name, GptOssReasoningParser)

__all__ = [
    "DeepSeekR1ReasoningParser",
    "GenericReasoningParser",
    "GptOssReasoningParser",
    "HarmonyThinking",
    "MarkerThinking",
    "Qwen3ReasoningParser",
    "Reasoner",
    "ReasoningError",
    "ReasoningMarkers",
    "ReasoningParser",
    "ThinkingState",
    "make_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
