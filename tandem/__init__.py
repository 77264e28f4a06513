"""tandem: an LLM inference engine in which the host CPU works beside the accelerator.

Public face (vLLM-shaped): `LLM`, `SamplingParams`, `StructuredOutputsParams`. The engine (and torch) is imported
on first use of `LLM` / `build_engine`, so helper processes that import one tandem module (a grammar compile
worker) stay small.
"""

from __future__ import annotations

from typing import Any

from tandem.params import ParamError, RequestOutputKind, SamplingParams, StructuredOutputsParams
from tandem.request import CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "ParamError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "build_engine",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "build_engine"):
        from tandem.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
