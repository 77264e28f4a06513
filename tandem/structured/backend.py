"""The structured-output contract: a grammar spec, a compiled grammar, a per-request matcher, and a backend.

A backend turns a `GrammarSpec` (plain strings, taken from `StructuredOutputsParams`) into a `CompiledGrammar`
once (slow, cached by the manager) and makes a cheap `Matcher` per request from it. A matcher walks one request's
output token by token and writes its allowed-token bitmask into a row of a shared int32 array:

    bitmask: int32 [R, ceil(V / 32)];  token t is allowed in row r  <=>  (bitmask[r, t // 32] >> (t % 32)) & 1

where V is the model's logits width. Token ids at or above the tokenizer's own vocabulary (padding ids of the
logits) are never allowed. EOS is allowed exactly where the grammar accepts; once a matcher has accepted EOS it is
terminated and its row allows only EOS.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.params import StructuredOutputsParams

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
JSON_KINDS = ("json", "json_object")
# The structural-tag formats (xgrammar's names and fields) that both backends compile: a tag is begin + content
# + end; contents are JSON schemas, literals, sequences, alternatives or free text; `tags_with_separator` lists
# tags with nothing else between them; `triggered_tags` lets free text run until a trigger string, then holds the
# output to one of the tags that begin with it (tool calls in "auto" mode).
STRUCTURAL_TAG_FORMATS = ("const_string", "json_schema", "any_text", "sequence", "or", "tag", "tags_with_separator",
                          "triggered_tags")


class GrammarError(ValueError):
    """A backend rejected a spec (or the manager refused it); the message names the backend and its reason."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason


class GrammarQueueFull(GrammarError):
    """Too many distinct grammars are waiting for a compile; the request is refused, not queued without bound."""


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint as plain strings: `kind` in KINDS, `text` its schema / regex / grammar / choice list,
    `whitespace` 'compact' | 'flexible'.

    `whitespace` only shapes the JSON kinds; for the others it is normalised to 'compact' so that equal regexes,
    choices and grammars share one cache entry.
    """

    kind: str
    text: str
    whitespace: str = "compact"

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        kind = params.kind
        whitespace = params.whitespace if kind in JSON_KINDS else "compact"
        return cls(kind=kind, text=params.grammar_text, whitespace=whitespace)

    @property
    def size_bytes(self) -> int:
        """The text's UTF-8 size (what `max_grammar_bytes` limits)."""
        return len(self.text.encode("utf-8"))

    def choices(self) -> list[str]:
        """The literals of a 'choice' spec (a JSON list of strings)."""
        values = json.loads(self.text)
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
            raise ValueError("choice spec must be a JSON list of non-empty strings")
        return values


class CompiledGrammar(Protocol):
    """A backend's compiled form of one spec; shared read-only by all matchers made from it."""

    @property
    def backend(self) -> str:
        """The name of the backend that compiled it."""
        ...

    @property
    def memory_bytes(self) -> int:
        """The backend's estimate of the memory it holds (what the manager's cache bound counts)."""
        ...


class Matcher(Protocol):
    """One request's position in its grammar. Not thread-safe; distinct matchers may run on distinct threads."""

    def accept(self, tokens: Sequence[int]) -> int:
        """Advance over `tokens`; stop at the first token the grammar rejects (not consumed). Returns how many."""
        ...

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over `tokens` known to be allowed (sampled under this matcher's mask, or validated), without
        the check `accept` makes first. Raises GrammarError if one is rejected after all: the matcher is then
        unusable (its request ends)."""
        ...

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Overwrite `bitmask[row]` (int32 [R, ceil(V/32)]) with the tokens allowed next. State is unchanged."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (EOS included)."""
        ...

    def is_terminated(self) -> bool:
        """True once EOS has been accepted."""
        ...

    def forced_tokens(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces next (empty when more than one continuation is possible).
        State is unchanged."""
        ...

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the masks would allow one after another, without changing state (drafts and
        argmaxes checked unmasked): exactly where `validates_as_masks`; else what `accept` would take. (llguidance's
        masks in a forced run take fewer than its language: see LLGuidanceMatcher.)"""
        ...


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer vocabulary and makes matchers; built once per engine."""

    name: str
    vocab_size: int  # V, the bitmask covers ceil(V / 32) words
    # `Matcher.validate` takes exactly the tokens `fill_bitmask` allows, so a validated argmax is the masked argmax
    # (unmasked greedy rows rely on it); xgrammar's masks can be narrower than its matcher (left recursion)
    validates_as_masks: bool
    # `prepare_batch`'s call fills many rows in one library call on the library's own threads, the GIL released once: the
    # manager hands it a step's rows at once; otherwise rows are filled one by one over the manager's fill pool
    fills_in_batches: bool

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (thread-safe; may take long). Raises GrammarError with the backend's reason."""
        ...

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        """A fresh matcher at the grammar's start (cheap)."""
        ...

    def prepare_batch(self, work: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> Callable[[], None]:
        """The Python part of filling `work` (distinct matchers of this backend and rows), done on the calling thread;
        returns the call that fills the rows as `Matcher.fill_bitmask` would (a matcher whose state is broken gets a
        row allowing only EOS), which may run on another thread and holds the GIL as little as the library allows.
        Until that call returns, the matchers must not be used and `bitmask` must be neither read nor freed."""
        ...

    def close(self) -> None:
        """Stop what the backend runs besides the caller's threads (compile worker processes); idempotent."""
        ...


def check_structural_tag(text: str) -> dict[str, Any]:
    """Parse a structural tag's JSON and check that every nested format is one of STRUCTURAL_TAG_FORMATS with the
    fields it needs; returns the parsed object. Raises ValueError naming the first problem."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural tag is not valid JSON: {e}") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("format"), dict):
        raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')
    _check_format(obj["format"], "format")
    return obj


_FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "const_string": ("value",), "json_schema": ("json_schema",), "any_text": (), "sequence": ("elements",),
    "or": ("elements",), "tag": ("begin", "content", "end"), "tags_with_separator": ("tags", "separator"),
    "triggered_tags": ("triggers", "tags"),
}


def _check_format(fmt: Any, where: str) -> None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _FORMAT_FIELDS:
        raise ValueError(f"{where}: unsupported structural tag format {kind!r}; supported: {list(STRUCTURAL_TAG_FORMATS)}")
    missing = [f for f in _FORMAT_FIELDS[kind] if f not in fmt]
    if missing:
        raise ValueError(f"{where}: a {kind!r} format needs {missing}")
    if kind == "tag":
        if not isinstance(fmt["begin"], str) or not isinstance(fmt["end"], (str, list)):
            raise ValueError(f"{where}: a tag's begin must be a string and its end a string or a list of strings")
        _check_format(fmt["content"], f"{where}.content")
    for i, sub in enumerate(fmt.get("elements", ()) if kind in ("sequence", "or") else ()):
        _check_format(sub, f"{where}.elements[{i}]")
    for i, sub in enumerate(fmt.get("tags", ())):
        if not isinstance(sub, dict) or sub.get("type", "tag") != "tag":
            raise ValueError(f"{where}.tags[{i}]: must be a tag")
        _check_format({**sub, "type": "tag"}, f"{where}.tags[{i}]")
    if kind == "triggered_tags":
        triggers = fmt["triggers"]
        if not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}: triggers must be non-empty strings")
        for i, sub in enumerate(fmt["tags"]):
            if not any(sub["begin"].startswith(t) for t in triggers):
                raise ValueError(f"{where}.tags[{i}]: its begin {sub['begin']!r} starts with none of the triggers")
    if fmt.get("excludes"):
        raise ValueError(f"{where}: 'excludes' is not supported")
    if kind == "json_schema":
        _check_json_format(fmt, where)


def _check_json_format(fmt: dict[str, Any], where: str) -> None:
    """A json_schema format: standard JSON in the schema's key order; max_whitespace_cnt a count if given."""
    if fmt.get("style", "json") != "json" or fmt.get("any_order"):
        raise ValueError(f"{where}: only the 'json' style in schema order is supported")
    limit = fmt.get("max_whitespace_cnt")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"{where}: max_whitespace_cnt must be an integer >= 1")


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per bitmask row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask with every token allowed: int32 [rows, ceil(V/32)], all bits set."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    """The token ids whose bit is set in `bitmask[row]` (ascending), as int64 [n_allowed]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask[row]).view(np.uint8), bitorder="little")  # [32 * words]
    return np.flatnonzero(bits[:vocab_size])


def is_allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    """Whether `token`'s bit is set in `bitmask[row]`."""
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def popcount(row: np.ndarray) -> int:
    """How many tokens a bitmask row ([W] int32) allows."""
    return int(np.bitwise_count(np.ascontiguousarray(row).view(np.uint32)).sum())


def fill_only(bitmask: np.ndarray, row: int, tokens: Sequence[int]) -> None:
    """Overwrite `bitmask[row]` so that exactly `tokens` are allowed."""
    words = bitmask[row].view(np.uint32)  # [W]; uint32 view so that bit 31 can be set with plain ints
    words[:] = 0
    for t in tokens:
        words[t >> 5] |= np.uint32(1 << (t & 31))


def check_bitmask(bitmask: np.ndarray, vocab_size: int) -> None:
    """Raise ValueError unless `bitmask` is a C-contiguous int32 [R, ceil(V/32)] array."""
    words = bitmask_words(vocab_size)
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be int32 [R, {words}] for vocab_size {vocab_size}, got {bitmask.dtype} {bitmask.shape}")
    if not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask must be C-contiguous")


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def backend_reason(exc: BaseException) -> str:
    """A library exception's message without C++ log prefixes ('[12:00:00] /path/file.cc:94: ') or tracebacks."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    first = _LOG_PREFIX.sub("", lines[0]) if lines else text
    rest = [line for line in lines[1:] if not line.lstrip().startswith(("File ", "Stack trace", "  "))]
    return " ".join([first, *rest[:3]]).strip()


# --- vocabularies that do not come from a Hugging Face tokenizer (large-vocabulary mask benchmarks) ---------------

# The pre-tokenization patterns tiktoken ships for its encodings (only used by llguidance's own tokenize()).
TIKTOKEN_PATTERNS = {
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
    "cl100k_base": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""",
}
TIKTOKEN_SPECIALS = {
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    "cl100k_base": {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
}


@dataclass(frozen=True)
class TiktokenVocab:
    """A tiktoken BPE vocabulary: `ranks` (token bytes -> id), named special tokens, the split pattern."""

    name: str
    ranks: dict[bytes, int] = field(repr=False)
    special_tokens: dict[str, int]
    pattern: str = field(repr=False)

    @property
    def size(self) -> int:
        """Number of ids (ordinary and special tokens, gaps included)."""
        return max([*self.ranks.values(), *self.special_tokens.values()]) + 1

    @property
    def eos_token_id(self) -> int:
        return self.special_tokens["<|endoftext|>"]

    def token_bytes(self) -> list[bytes]:
        """Bytes of every id; special tokens and unused ids are b'' (which both libraries treat as never allowed)."""
        vocab = [b""] * self.size
        for piece, rank in self.ranks.items():
            vocab[rank] = piece
        return vocab

    def encode_greedy(self, text: str) -> list[int]:
        """Longest-match tokenization of `text` (a valid, if not BPE-canonical, tokenization; for tests)."""
        data = text.encode("utf-8")
        longest = max(len(p) for p in self.ranks)
        ids: list[int] = []
        i = 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                rank = self.ranks.get(data[i : i + n])
                if rank is not None:
                    ids.append(rank)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]} at {i} has no token")
        return ids


def load_tiktoken(path: str | Path) -> TiktokenVocab:
    """Read a `.tiktoken` file (lines 'base64(token) rank'); the name (o200k_base, cl100k_base) picks the pattern."""
    path = Path(path)
    name = path.name.removesuffix(".tiktoken")
    if name not in TIKTOKEN_PATTERNS:
        raise ValueError(f"unknown tiktoken encoding {name!r}; known: {sorted(TIKTOKEN_PATTERNS)}")
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            piece, rank = line.split()
            ranks[base64.b64decode(piece)] = int(rank)
    return TiktokenVocab(name, ranks, dict(TIKTOKEN_SPECIALS[name]), TIKTOKEN_PATTERNS[name])
