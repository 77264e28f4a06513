"""Structured outputs on the host CPU: grammar compilation, per-request matchers and token bitmasks.

`StructuredOutputManager` is what the engine uses; the backends (xgrammar, llguidance) sit behind the
`GrammarBackend` / `Matcher` protocols in `backend`. The backend modules import their libraries, so they are
imported lazily by the manager.
"""

from __future__ import annotations

from tandem.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarQueueFull,
    GrammarSpec,
    Matcher,
    TiktokenVocab,
    allocate_bitmask,
    allowed_tokens,
    bitmask_words,
    is_allowed,
    load_tiktoken,
)
from tandem.structured.cache import GrammarCache
from tandem.structured.manager import StructuredOutputConfig, StructuredOutputManager
from tandem.structured.measure import measure_mask_fill

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "GrammarQueueFull",
    "GrammarSpec",
    "Matcher",
    "StructuredOutputConfig",
    "StructuredOutputManager",
    "TiktokenVocab",
    "allocate_bitmask",
    "allowed_tokens",
    "bitmask_words",
    "is_allowed",
    "load_tiktoken",
    "measure_mask_fill",
]
