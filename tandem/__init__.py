"""tandem: an LLM inference engine in which the host CPU works beside the accelerator.

Public face (vLLM-shaped): `LLM`, `SamplingParams`, `StructuredOutputsParams`.
"""

from __future__ import annotations

from tandem.engine.llm import LLM, build_engine
from tandem.params import ParamError, SamplingParams, StructuredOutputsParams
from tandem.request import CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "ParamError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "build_engine",
]
__version__ = "0.1.0"
