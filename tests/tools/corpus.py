"""The function-definition corpus (tests/data/functions/*.json) as the tests use it: each entry is a user prompt and
one OpenAI function definition; tool sets are drawn as `tandem bench tools` and `tandem bench serve` draw them."""

from __future__ import annotations

from typing import Any

from tandem.bench.tools import as_tool, load_functions, tool_set

__all__ = ["load_corpus", "tool", "tool_set"]


def load_corpus() -> list[dict[str, Any]]:
    """Every entry, files in name order: {"prompt": str, "function": {name, description, parameters}}."""
    return load_functions()


def tool(entry: dict[str, Any]) -> dict[str, Any]:
    return as_tool(entry)
