"""Many distinct JSON schemas, as real traffic sends them (every client's response model, every tool set).

`distinct_schemas(n, seed)` builds `n` different schemas deterministically from a pool of record kinds and field
templates (strings with lengths and formats, enums, integers and numbers with ranges, nested objects, arrays,
optional fields), so benchmarks compile `n` grammars instead of one. `suite_schemas()` adds the object schemas of
the JSON-Schema-Test-Suite in ../shared/data that carry no remote references.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tandem.bench.common import shared_data_dir

_KINDS = ["person", "order", "invoice", "event", "ticket", "product", "flight", "recipe", "book", "employee",
          "review", "shipment", "patient visit", "bank transfer", "job posting", "weather report", "meeting",
          "support case", "car listing", "hotel booking"]
_WORDS = ["name", "title", "city", "country", "email", "status", "priority", "category", "notes", "owner", "code",
          "label", "language", "currency", "color", "brand", "model", "reason", "source", "channel", "region",
          "summary", "author", "vendor", "team", "tier", "level", "stage", "kind", "origin"]
_ENUMS = [["low", "medium", "high"], ["open", "closed", "pending"], ["red", "green", "blue", "black"],
          ["EUR", "USD", "GBP", "JPY"], ["draft", "sent", "paid", "void"], ["yes", "no"], ["economy", "business", "first"]]


def _field(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "enum", "integer", "number", "boolean", "array", "object", "date"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24, 40])}
    if kind == "date":
        return {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
    if kind == "enum":
        return {"enum": rng.choice(_ENUMS)}
    if kind == "integer":
        lo = rng.choice([0, 1, 18, 100])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([10, 99, 1000])}
    if kind == "number":
        return {"type": "number", "minimum": 0}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array" or depth >= 2:
        return {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": rng.choice([2, 3, 5])}
    return _object(rng, depth + 1, rng.randint(2, 3))


def _object(rng: random.Random, depth: int, n_fields: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, n_fields)
    props = {name: _field(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def distinct_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` pairwise different record schemas (same `seed`, same list)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(out) < n:
        schema = _object(rng, 0, rng.randint(3, 6))
        schema["title"] = f"{rng.choice(_KINDS)} {len(out)}"
        text = json.dumps(schema, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append(schema)
    return out


def suite_schemas(limit: int | None = None) -> list[dict[str, Any]]:
    """Object schemas from the JSON-Schema-Test-Suite (draft 2020-12) without remote or dynamic references."""
    root = shared_data_dir() / "schemas" / "JSON-Schema-Test-Suite" / "draft2020-12"
    out: list[dict[str, Any]] = []
    for path in sorted(Path(root).glob("*.json")):
        for group in json.loads(path.read_text()):
            schema = group.get("schema")
            text = json.dumps(schema)
            if isinstance(schema, dict) and schema.get("type") == "object" and "://" not in text and "$dynamic" not in text:
                out.append(schema)
    return out[:limit] if limit is not None else out


def describe(schema: dict[str, Any]) -> str:
    """A one-line request for a record of this schema (the prompt a client would send)."""
    fields = ", ".join(schema.get("properties", {}))
    return f"Give one example {schema.get('title', 'record')} as JSON with the fields {fields}."
