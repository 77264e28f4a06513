"""Tool calling, shared by the server and the offline API: plan.py (tools + tool_choice -> the prompt to template
and the structural-tag grammar that holds every call to its function's schema), parsers.py (the tool-call
formats: Hermes / Qwen, Llama 3 JSON, Mistral, gpt-oss's harmony, and the incremental parsers of whole and streamed
outputs) and harmony.py (gpt-oss's chat format: vocabulary found offline, rendering, reading messages by channel).
Nothing here runs a model or imports the server."""

from __future__ import annotations

from tandem.tools.parsers import (
    PARSERS,
    CallStream,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    make_parser,
)
from tandem.tools.plan import ToolError, ToolPlan, choose_parser

__all__ = [
    "PARSERS",
    "CallStream",
    "ParsedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolError",
    "ToolParser",
    "ToolPlan",
    "choose_parser",
    "make_parser",
]
