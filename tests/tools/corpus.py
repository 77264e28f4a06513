"""The function-definition corpus (tests/data/functions/*.json) and the tool sets the tests and benchmarks build
from it: each entry is a user prompt and one OpenAI function definition."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "functions"


def load_corpus() -> list[dict[str, Any]]:
    """Every entry, files in name order: {"prompt": str, "function": {name, description, parameters}}."""
    entries: list[dict[str, Any]] = []
    for path in sorted(CORPUS_DIR.glob("*.json")):
        entries.extend(json.loads(path.read_text()))
    return entries


def tool(entry: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": entry["function"]}


def tool_set(corpus: list[dict[str, Any]], i: int, size: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Entry i's tool plus size - 1 others drawn from the corpus: a distinct tool set per request."""
    rng = random.Random(seed * 100003 + i)
    others = rng.sample([j for j in range(len(corpus)) if j != i], size - 1)
    chosen = [i, *others]
    rng.shuffle(chosen)
    return [tool(corpus[j]) for j in chosen]
