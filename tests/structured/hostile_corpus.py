"""A corpus of hostile structured-output requests: inputs built to blow up a grammar backend at compile time or at
run time, invalid ones, unsatisfiable ones, huge ones. Each entry is the `structured_outputs` body of one request
(what a client would send), so the engine tests and the server tests send exactly the same thing.

Every entry must end as a 4xx or a 200 (an "error" finish for the engine), never take the engine down, never delay
the normal requests beside it beyond the compile budget. Kept as data + small generators; no randomness.
"""

from __future__ import annotations

import json
from typing import Any

Entry = tuple[str, dict[str, Any]]  # (name, structured_outputs body)

_BLOWUP_REGEXES = [
    "(a|aa)*(b|bb){1000}{1000}",
    "(a|aa)*(b|bb){1000}",
    "((a*)*)*b",
    "(x+x+)+y",
    "(a{1,50}){1,50}",
    "(\\w+\\s?){1,300}",
    "(\\w+\\s?){1,1000}",
    ".{20000}",
    "[a-z]{1,100000}",
    "(ab|cd|ef){5000}",
    "\\p{L}{1,2000}",
    "((((((((((a*)*)*)*)*)*)*)*)*)*)*",
    "(a|b|c|d|e|f|g|h|i|j)*(k{1,100}){1,100}",
    "(?:[0-9]+,)*[0-9]+{2}",
    "(.*){100}",
    "(.*a){30}",
    "([a-z]+)*[0-9]{1,9999}",
    "(a?){50}a{50}",
]
_INVALID_REGEXES = [
    "(?=abc)abc", "(?!x).*", "(?<=a)b", "(?<!a)b", "(a)\\1", "[", "(", ")", "*a", "a{2,1}", "(?P<x>", "a**",
    "[z-a]", "\\", "a{99999999999}", "(?i", "\\k<name>", "[[:alpha:]", "\x00", "\ud800",
]
_GBNF = [
    'root ::= root "a" | "b"',
    "root ::= root",
    "root ::= x\nx ::= x x | \"a\"",
    "root ::= ",
    "root ::= undefined_rule",
    'root ::= "a" (root)*',
    'root ::= [\\x00-\\U0010FFFF]*',
    "root ::= (((((((((((\"a\")))))))))))*",
    "this is not a grammar",
    'root ::= "a" | ',
    'root ::= "\\xZZ"',
    "\n".join(["root ::= r0"] + [f'r{i} ::= r{i + 1} | "{i}"' for i in range(1500)] + ['r1500 ::= "end"']),
    "\n".join(["root ::= " + " ".join(f"r{i}" for i in range(300))] + [f'r{i} ::= "x"*' for i in range(300)]),
]
_LARK = [
    "start: start \"a\" | \"b\"",
    "start: /(a|aa)*(b|bb){1000}/",
    "start: A+\nA: /(\\w+\\s?){1,300}/",
    "%import common.NUMBER\nstart: NUMBER",
    "start: x\nx: x x | \"a\"",
    "start:",
    "start: %ignore",
    'start: "a" b\nb: /[/',
    "start: /.{50000}/",
    "start: lazy_thing\nlazy_thing[lazy]: /.*/ \"end\"",
]


def _deep_object(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _deep_array(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1}
    return schema


def _schemas() -> list[Entry]:
    out: list[Entry] = []
    for depth in (30, 60, 120, 250):
        out.append((f"deep-object-{depth}", {"json": _deep_object(depth)}))
        out.append((f"deep-array-{depth}", {"json": _deep_array(depth)}))
    for depth in (600, 5000):  # as text: deeper than Python's own json module nests
        out.append((f"deep-object-text-{depth}", {"json": deep_json_text(depth)}))
    for n in (1000, 5000, 20000):
        out.append((f"enum-{n}", {"json": {"enum": [f"value_{i}" for i in range(n)]}}))
    for n in (300, 1500):
        props = {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(n)}
        out.append((f"properties-{n}", {"json": {"type": "object", "properties": props, "required": list(props)}}))
        out.append((f"anyof-{n}", {"json": {"anyOf": [{"const": f"c{i}"} for i in range(n)]}}))
    for rx in _BLOWUP_REGEXES[:8]:
        out.append((f"pattern:{rx[:24]}", {"json": {"type": "string", "pattern": rx}}))
        out.append((f"pattern-in-array:{rx[:16]}", {"json": {"type": "array", "items": {"type": "string", "pattern": rx}}}))
    out += [
        ("unsatisfiable-min-max", {"json": {"type": "integer", "minimum": 5, "maximum": 1}}),
        ("unsatisfiable-allof", {"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}),
        ("unsatisfiable-not", {"json": {"not": {}}}),
        ("false-schema", {"json": False}),
        ("empty-enum", {"json": {"enum": []}}),
        ("min-items-over-max", {"json": {"type": "array", "minItems": 5, "maxItems": 2}}),
        ("minlength-huge", {"json": {"type": "string", "minLength": 1_000_000}}),
        ("maxitems-huge", {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 100000}}),
        ("recursive-ref", {"json": {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}}),
        ("self-ref-object", {"json": {"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}},
                                                          "required": ["n"]}}, "$ref": "#/$defs/n"}}),
        ("dangling-ref", {"json": {"$ref": "#/$defs/missing"}}),
        ("remote-ref", {"json": {"$ref": "http://example.invalid/schema.json"}}),
        ("unknown-type", {"json": {"type": "frobnicate"}}),
        ("type-list-weird", {"json": {"type": ["string", 7, None]}}),
        ("unique-items", {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
        ("pattern-properties-blowup", {"json": {"type": "object", "patternProperties": {"(a|aa)*(b|bb){200}": {"type": "string"}}}}),
        ("property-names", {"json": {"type": "object", "propertyNames": {"pattern": "^(x+x+)+y$"}}}),
        ("format-unknown", {"json": {"type": "string", "format": "no-such-format"}}),
        ("multiple-of-float", {"json": {"type": "number", "multipleOf": 0.0000001}}),
        ("null-bytes-in-keys", {"json": {"type": "object", "properties": {"a\x00b": {"type": "string"}}, "required": ["a\x00b"]}}),
        ("huge-key", {"json": {"type": "object", "properties": {"k" * 20000: {"type": "string"}}, "required": ["k" * 20000]}}),
        ("const-huge", {"json": {"const": "x" * 30000}}),
        ("if-then-else", {"json": {"if": {"type": "string"}, "then": {"minLength": 3}, "else": {"type": "integer"}}}),
        ("dependent-schemas", {"json": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}}),
        ("oneof-overlap", {"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}),
        ("schema-is-list", {"json": "[1, 2, 3]"}),
        ("schema-not-json", {"json": "{this is not json"}),
        ("schema-over-size-limit", {"json": {"type": "object", "description": "d" * 100_000}}),
    ]
    return out


def _choices() -> list[Entry]:
    return [
        ("choice-10000", {"choice": [f"option number {i}" for i in range(10000)]}),
        ("choice-2000-shared-prefix", {"choice": ["prefix-" * 20 + str(i) for i in range(2000)]}),
        ("choice-huge-single", {"choice": ["z" * 50_000]}),
        ("choice-duplicates", {"choice": ["same"] * 500}),
        ("choice-unicode", {"choice": ["é" * 100, "日本語" * 50, "\U0001F600" * 30]}),
        ("choice-empty-list", {"choice": []}),
        ("choice-empty-string", {"choice": ["", "a"]}),
        ("choice-control-chars", {"choice": ["\x00\x01\x02", "\n\t\r"]}),
    ]


def corpus() -> list[Entry]:
    """Every hostile entry, with each backend forced as well as `auto` where the backends differ."""
    out: list[Entry] = []
    for rx in _BLOWUP_REGEXES:
        for backend in ("auto", "xgrammar", "llguidance"):
            out.append((f"regex[{backend}]:{rx[:30]}", {"regex": rx, "backend": backend}))
    for rx in _INVALID_REGEXES:
        out.append((f"bad-regex:{rx[:20]!r}", {"regex": rx}))
    for g in _GBNF:
        for backend in ("auto", "xgrammar"):
            out.append((f"gbnf[{backend}]:{g[:24]!r}", {"grammar": g, "backend": backend}))
    for g in _LARK:
        out.append((f"lark:{g[:24]!r}", {"grammar": g, "backend": "llguidance"}))
    for name, body in _schemas():
        out.append((name, body))
        out.append((f"{name}[xgrammar]", {**body, "backend": "xgrammar"}))
    out += _choices()
    out += [("json-object-flexible", {"json_object": True, "whitespace": "flexible"}),
            ("two-kinds-at-once", {"json": {"type": "string"}, "regex": "a+"}),
            ("no-kind", {}),
            ("unknown-backend", {"regex": "a", "backend": "outlines"}),
            ("whitespace-bad", {"json": {"type": "string"}, "whitespace": "sideways"})]
    return out


def deep_json_text(depth: int) -> str:
    """A schema nested `depth` objects deep, as JSON text built without recursion (deeper than Python's json
    module can encode: a client in another language sends such bodies)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def request_body_text(body: dict[str, Any]) -> str:
    """`body` as JSON text, ASCII-escaped (lone surrogates travel as the escapes a client would send)."""
    return json.dumps(body)
