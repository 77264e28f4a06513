"""llguidance backend: JSON schema, any JSON object, regex (Rust `regex` syntax), choice, Lark and GBNF grammars,
and structural tags (translated to Lark: `StructuralTagLark`).

llguidance computes masks lazily (a derivative-based lexer over a token trie plus an Earley parser), so its
"compile" is cheap: we translate the spec to llguidance's grammar JSON and build one prototype `LLMatcher`, which
validates it; each request's matcher is a `deep_copy()` of the prototype (microseconds). One matcher's mask fill
holds the GIL; a step's fills go to llguidance's own threads in one call (`prepare_batch`). The 'grammar' kind
accepts Lark text and llama.cpp GBNF (converted to Lark by `llguidance.grammar_from`).

Choices made here:
- JSON schemas use JSON Schema semantics (extra object keys allowed unless `additionalProperties: false`); the
  whitespace setting overrides any `x-guidance` in the schema. Unimplemented keywords are errors (not ignored).
- llguidance has no memory-size API; `memory_bytes` is an estimate (see `_estimate_bytes`).
- `LLMatcher` never raises on bad input: a bad grammar shows up as `is_error()` on the prototype, which we turn
  into a GrammarError; tokens are validated before they are consumed, so a request's matcher never enters the
  error state. EOS is judged with `is_accepting()` and kept out of llguidance's history (see LLGuidanceMatcher).
- GBNF is converted to Lark, where rules made only of terminals become greedy lexemes: llama.cpp's
  arithmetic.gbnf (`num ::= [0-9]+ ws`, `ws ::= [ \t\n]*`, then a literal "\n") can never end, because the
  final newline is swallowed by the NUM lexeme. xgrammar (a pure CFG) accepts it.
- Structural tags: free text before a trigger is one lazy lexeme `TAG_TEXT "trigger"` (it ends at the trigger's
  first occurrence, so the text can never run past a trigger unconstrained); JSON inside a tag takes any JSON
  whitespace, in runs of at most `max_whitespace_cnt` characters when given, as xgrammar's structural tags do.
  llguidance treats every added token of an HF vocabulary as special (Qwen's `<tool_call>` too, though it is not),
  so tag literals that contain one accept the token or its text, and such a trigger also fires as the token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import numpy as np

from tandem.structured.backend import (
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    Matcher,
    TiktokenVocab,
    backend_reason,
    check_bitmask,
    check_structural_tag,
    fill_only,
)

_OBJECT_SCHEMA = '{"type": "object"}'
_BASE_BYTES = 64 * 1024  # fixed cost of a prototype matcher (parser tables, lexer start state)
_BYTES_PER_GRAMMAR_CHAR = 16  # the grammar JSON expands into rules, lexemes and lazily built lexer states


def _estimate_bytes(grammar_json: str) -> int:
    """A rough memory estimate: llguidance exposes none, and its lexer grows lazily with use."""
    return _BASE_BYTES + _BYTES_PER_GRAMMAR_CHAR * len(grammar_json)


@dataclass(frozen=True)
class LLGuidanceCompiled:
    """A validated llguidance grammar (JSON text) and a prototype matcher at its start state (never advanced)."""

    grammar: str = field(repr=False)
    prototype: Any = field(repr=False)  # llguidance.LLMatcher
    memory_bytes: int
    backend: str = "llguidance"


class LLGuidanceMatcher:
    """One request's `LLMatcher`; EOS is handled here, never passed to llguidance.

    Why: in llguidance 1.9, once the parser is stopped (nothing can follow, e.g. after a full choice) an EOS is
    refused by `validate_tokens` but taken by `consume_token` without entering the token history, so a later
    `rollback(n)` would undo one real token too many. Here EOS is accepted iff `is_accepting()`, recorded as
    `_terminated`, and is always the last accepted token; rolling back starts by dropping it.

    Validation takes what the masks take (`accept` what the language takes: tokens another backend sampled, replayed
    into this one, spell the same text). Where the grammar forces bytes, llguidance's mask allows one token only: the
    first of the forced bytes' canonical tokenization (`compute_ff_tokens()[0]`; "forcing ff_token by mask" in its
    `compute_mask`), while `validate_tokens` takes any token spelling a prefix of those bytes (after `{"name":"x"` in
    a schema forcing `,"age":`, SmolLM2's `,` as well as the mask's `,"`). An argmax or a draft validated unmasked
    stands for the masked one (`validates_as_masks`), so `validate` refuses, in a forced state, every token but that
    one: otherwise a greedy answer depended on its path (stories260K's to a choice of "Lily ran" /
    "Lily sat": "L" "ily" " s" under the mask, "L" "il" "y" validated unmasked). Measured over 900 forced states on
    stories260K's and SmolLM2's vocabularies: every mask was exactly that token; outside them, exactly what
    `validate_tokens` takes. (`no_forcing` would make the masks take what validation takes, but llguidance's authors
    advise against it outside testing, for quality and speed; measured here, it made schema compiles 2.3x slower.)
    """

    def __init__(self, compiled: LLGuidanceCompiled, eos_token_ids: Sequence[int]) -> None:
        self._matcher = compiled.prototype.deep_copy()
        self._eos = list(eos_token_ids)
        self._eos_set = frozenset(self._eos)
        self._terminated = False  # EOS accepted (it is not in llguidance's history)

    def accept(self, tokens: Sequence[int]) -> int:
        """Validate first, then consume the valid prefix, so a bad token never puts the matcher in error state."""
        if self._terminated:
            return 0
        body, eos_next = self._split_at_eos(tokens)
        n = int(self._matcher.validate_tokens(body)) if body else 0  # the language's check, not the masks'
        if n and not self._matcher.consume_tokens(body[:n]):
            raise GrammarError("llguidance", f"consume failed after validation: {self._matcher.get_error()}")
        if n == len(body) and eos_next and self._matcher.is_accepting():
            self._terminated = True
            n += 1
        return n

    def consume(self, tokens: Sequence[int]) -> None:
        """No `validate_tokens` first (it cost as much as the consume itself, for every sampled token)."""
        if len(tokens) == 1 and not self._terminated and tokens[0] not in self._eos_set:  # a step's one token
            if not self._matcher.consume_tokens(tokens):
                raise self._rejected(tokens)
            return
        body, eos_next = self._split_at_eos(tokens)
        if self._terminated or (body and not self._matcher.consume_tokens(body)):
            raise self._rejected(tokens)
        if eos_next:
            if not self._matcher.is_accepting():
                raise GrammarError("llguidance", "EOS was sampled but the grammar cannot end here")
            self._terminated = True

    def _rejected(self, tokens: Sequence[int]) -> GrammarError:
        return GrammarError("llguidance", f"tokens {list(tokens)} were sampled but the grammar rejects them: "
                                          f"{self._matcher.get_error() or 'it has ended'}")

    def validate(self, tokens: Sequence[int]) -> int:
        if self._terminated:
            return 0
        if len(tokens) == 1 and tokens[0] not in self._eos_set:  # one argmax, candidate or probe: the hot case
            return int(self._matcher.validate_tokens(tokens) == 1 and self._masks_allow(int(tokens[0])))
        body, eos_next = self._split_at_eos(tokens)
        n = self._masked_prefix(body)
        if n == len(body) and eos_next:  # is EOS allowed after the body? look, then undo
            if n:
                self._matcher.consume_tokens(body)
            n += int(self._matcher.is_accepting())
            if body:
                self._matcher.rollback(len(body))
        return n

    @property
    def native(self) -> llguidance.LLMatcher:
        """The `LLMatcher` (for the backend's batched fills)."""
        return self._matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._terminated:
            fill_only(bitmask, row, self._eos)
            return
        target = bitmask[row]  # [W] int32, a C-contiguous view of one row
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._terminated:
            self._terminated = False
            n -= 1
        if n and not self._matcher.rollback(n):
            raise GrammarError("llguidance", f"cannot roll back {n} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_tokens(self, limit: int) -> list[int]:
        if self._terminated or limit <= 0:
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]

    def _split_at_eos(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """(the tokens before the first EOS, whether an EOS follows them)."""
        body: list[int] = []
        for token in tokens:
            if int(token) in self._eos_set:
                return body, True
            body.append(int(token))
        return body, False

    def _masked_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the masks would allow one after another (the matcher is left as it was)."""
        n = int(self._matcher.validate_tokens(tokens)) if tokens else 0
        if n == 0:
            return 0
        matcher, i = self._matcher, 0
        while i < n and self._masks_allow(tokens[i]):  # each in the state the tokens before it lead to
            i += 1
            if i < n:
                matcher.consume_tokens(tokens[i - 1 : i])
        walked = min(i, n - 1)  # tokens consumed to reach the state of the last one checked
        if walked and not matcher.rollback(walked):
            raise GrammarError("llguidance", f"cannot roll back {walked} tokens: {matcher.get_error()}")
        return i

    def _masks_allow(self, token: int) -> bool:
        """Whether this state's mask allows `token`, given that `validate_tokens` does: outside a forced state
        always; in one, iff it is the forced bytes' first canonical token. (Forced bytes are looked for first,
        ~0.1 us, against ~10 us for the forced tokens.)"""
        if not self._matcher.compute_ff_bytes():
            return True
        forced = self._matcher.compute_ff_tokens()
        return not forced or forced[0] == token


class LLGuidanceBackend:
    """Compiles specs against one `llguidance.LLTokenizer` (thread-safe: compiles share only the tokenizer)."""

    name = "llguidance"
    validates_as_masks = True  # masks and validation walk the same lexer and parser (forced runs: `_masks_allow`)
    # one `LLExecutor` call fills a step's rows on its own threads, the GIL released once: a single matcher's fill
    # holds the GIL (256 rows over o200k: 3.1 ms on one Python thread, 3.4 ms split over two, 1.4 ms in one call
    # on two executor threads)
    fills_in_batches = True

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = (), fill_threads: int = 2) -> None:
        """Wrap a fast Hugging Face tokenizer; `vocab_size` is the logits width (ids past the tokenizer: never allowed);
        `fill_threads`: the threads of `prepare_batch`'s call."""
        eos = list(eos_token_ids) or [int(hf_tokenizer.eos_token_id)]
        tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        added = {int(i): str(t.content) for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()}
        self._setup(tokenizer, vocab_size, eos, {text: i for i, text in added.items() if i < vocab_size and tokenizer.is_special_token(i)},
                    fill_threads)

    @classmethod
    def from_tiktoken(cls, vocab: TiktokenVocab, vocab_size: int | None = None, eos_token_ids: Sequence[int] = (),
                      fill_threads: int = 2) -> LLGuidanceBackend:
        """A backend over a raw tiktoken vocabulary."""
        size = vocab_size or vocab.size
        eos = list(eos_token_ids) or [vocab.eos_token_id]
        tokenizer = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
            encoder=vocab.ranks, special_tokens=vocab.special_tokens, pattern=vocab.pattern, eos_token=eos, n_vocab=size
        )
        self = cls.__new__(cls)
        self._setup(tokenizer, size, eos, {t: i for t, i in vocab.special_tokens.items() if i < size}, fill_threads)
        return self

    def _setup(self, tokenizer: Any, vocab_size: int, eos: list[int], special: dict[str, int], fill_threads: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self._tokenizer = tokenizer
        self._executor = llguidance.LLExecutor(max(1, fill_threads))
        self.special_tokens = special  # text -> id of the tokens llguidance treats as special (structural tags)
        self._translators: dict[str, Callable[[GrammarSpec], str]] = {
            "json": lambda s: self._schema_grammar(s.text, s.whitespace),
            "json_object": lambda s: self._schema_grammar(_OBJECT_SCHEMA, s.whitespace),
            "regex": lambda s: llguidance.LLMatcher.grammar_from_regex(s.text),
            "choice": self._choice_grammar,
            "grammar": lambda s: llguidance.grammar_from("grammar", s.text),
            "structural_tag": lambda s: llguidance.LLMatcher.grammar_from_lark(StructuralTagLark.translate(s.text, special)),
        }

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        translate = self._translators.get(spec.kind)
        if translate is None:
            raise GrammarError(self.name, f"unsupported kind {spec.kind!r}")
        try:
            grammar = translate(spec)
        except GrammarError:
            raise
        except Exception as e:  # ValueError from the schema / GBNF translation
            raise GrammarError(self.name, backend_reason(e)) from e
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise GrammarError(self.name, prototype.get_error().strip())
        return LLGuidanceCompiled(grammar=grammar, prototype=prototype, memory_bytes=_estimate_bytes(grammar))

    def matcher(self, grammar: CompiledGrammar) -> LLGuidanceMatcher:
        assert isinstance(grammar, LLGuidanceCompiled), "a grammar compiled by another backend"
        return LLGuidanceMatcher(grammar, self.eos_token_ids)

    def prepare_batch(self, work: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> Callable[[], None]:
        check_bitmask(bitmask, self.vocab_size)  # the executor writes whole rows at the array's address
        if any(not 0 <= row < bitmask.shape[0] for _, row in work):
            raise ValueError(f"rows must be in [0, {bitmask.shape[0]})")
        pairs = []
        for matcher, row in work:
            assert isinstance(matcher, LLGuidanceMatcher), "a matcher of another backend"
            if matcher.is_terminated():
                fill_only(bitmask, row, self.eos_token_ids)
            else:
                pairs.append((matcher.native, row))
        if not pairs:
            return lambda: None
        executor, address, stride, rows = self._executor, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        return lambda: executor.unsafe_compute_mask_ptr(pairs, address, stride, rows)

    def close(self) -> None:
        """Nothing to stop: compiles run on the caller's threads."""

    def tokenize(self, text: str) -> list[int]:
        """llguidance's own tokenization of `text` (for tests and benchmarks)."""
        return [int(t) for t in self._tokenizer.tokenize_str(text)]

    @staticmethod
    def _schema_grammar(schema: str, whitespace: str) -> str:
        """compact: separators ',' ':' and no whitespace; flexible: any JSON whitespace around them."""
        options: dict[str, Any] = {"whitespace_flexible": whitespace == "flexible", "item_separator": ",", "key_separator": ":"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]

    def _choice_grammar(self, spec: GrammarSpec) -> str:
        """start: "lit1" | "lit2" | ...; JSON string escapes are valid Lark string escapes in llguidance."""
        try:
            literals = spec.choices()
        except ValueError as e:
            raise GrammarError(self.name, str(e)) from e
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in literals)
        return llguidance.LLMatcher.grammar_from_lark(lark)


_JSON_WHITESPACE = "[\\x20\\x0A\\x0D\\x09]"


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark escapes in llguidance); '' for the empty string."""
    return json.dumps(text, ensure_ascii=False) if text else ""


class StructuralTagLark:
    """Translates a structural tag (the formats of STRUCTURAL_TAG_FORMATS) into one llguidance Lark grammar.

    `special` maps the text of the vocabulary's added tokens that llguidance treats as special (it treats every
    added token so, `special: false` ones too: Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`) to their ids. Where a
    literal of the tag contains one, the grammar takes the token or the same text spelt in ordinary tokens, as
    xgrammar does (it reads such tokens as their text); a trigger that is one of them also starts a call when it
    comes as the token (free text never holds a special token, so the token needs no lazy lexeme).
    """

    def __init__(self, special: Mapping[str, int] | None = None) -> None:
        self.rules: list[str] = []
        self.uses_text = False
        self.special = dict(special or {})
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True))) if self.special else None

    @classmethod
    def translate(cls, text: str, special: Mapping[str, int] | None = None) -> str:
        """The Lark grammar of the structural tag `text`; ValueError when it uses an unsupported format."""
        self = cls(special)
        start = self.expr(check_structural_tag(text)["format"])
        if not start:
            raise ValueError("the structural tag matches only the empty string")
        lines = ["%llguidance {}", f"start: {start}", *self.rules]
        if self.uses_text:
            lines.append(r"TAG_TEXT: /(.|\n)*/")
        return "\n".join(lines) + "\n"

    def lit(self, text: str) -> str:
        """`text` as a Lark expression: a literal, with (<[id]> | "text") for each special token's text in it."""
        if self._special_re is None or not text:
            return _lit(text)
        parts, pos = [], 0
        for m in self._special_re.finditer(text):
            parts += [_lit(text[pos : m.start()]), f'(<[{self.special[m.group()]}]> | {_lit(m.group())})']
            pos = m.end()
        return " ".join(p for p in [*parts, _lit(text[pos:])] if p)

    def json_schema(self, fmt: dict[str, Any]) -> str:
        """%json with xgrammar's whitespace rule for structural tags: any JSON whitespace, in runs of at most
        `max_whitespace_cnt` characters when the format gives it."""
        schema = fmt["json_schema"]
        if isinstance(schema, dict):
            limit = fmt.get("max_whitespace_cnt")
            style: dict[str, Any] = {"whitespace_flexible": True}
            if limit is not None:
                style["whitespace_pattern"] = f"{_JSON_WHITESPACE}{{0,{int(limit)}}}"
            schema = {**schema, "x-guidance": style}
        return "%json " + json.dumps(schema)

    def rule(self, body: str, attrs: str = "") -> str:
        """A new rule `rN[attrs]: body`; its name."""
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def expr(self, fmt: dict[str, Any]) -> str:
        """A Lark expression for `fmt` ('' when it matches only the empty string)."""
        kind = fmt["type"]
        if kind == "const_string":
            return self.lit(fmt["value"])
        if kind == "json_schema":
            return self.json_schema(fmt)
        if kind == "any_text":
            self.uses_text = True
            return "TAG_TEXT"
        if kind == "sequence":
            return " ".join(e for e in (self.expr(x) for x in fmt["elements"]) if e)
        if kind == "or":
            return self.alternatives([self.expr(x) for x in fmt["elements"]])
        if kind == "tag":
            return self.tag(fmt, fmt["begin"])
        if kind == "tags_with_separator":
            return self.tags_with_separator(fmt)
        return self.triggered_tags(fmt)

    def alternatives(self, exprs: list[str]) -> str:
        """(a | b | ...), optional when one of them is empty."""
        filled = list(dict.fromkeys(e for e in exprs if e))
        if not filled:
            return ""
        body = self.rule(" | ".join(filled))
        return f"{body}?" if len(filled) < len(exprs) else body

    def tag(self, tag: dict[str, Any], begin: str) -> str:
        """`begin content end` (end: one string or alternatives)."""
        ends = tag["end"] if isinstance(tag["end"], list) else [tag["end"]]
        end = self.alternatives([self.lit(e) for e in ends]) if len(ends) > 1 else self.lit(ends[0])
        return " ".join(p for p in (self.lit(begin), self.expr(tag["content"]), end) if p)

    def tags_with_separator(self, fmt: dict[str, Any]) -> str:
        """Tags with `separator` between them and nothing else; `at_least_one`, `stop_after_first` as in xgrammar."""
        one = self.alternatives([self.tag(t, t["begin"]) for t in fmt["tags"]])
        sep = self.lit(fmt["separator"])
        many = one if fmt.get("stop_after_first") else self.rule(f"{one} ({sep} {one})*" if sep else f"{one}+")
        return many if fmt.get("at_least_one") else f"{many}?"

    def triggered_tags(self, fmt: dict[str, Any]) -> str:
        """Free text until a trigger (a lazy lexeme ending at its first occurrence, or the trigger's special token),
        then one of the tags that begin with that trigger, then free text again (unless `stop_after_first`)."""
        self.uses_text = True
        triggers = sorted(fmt["triggers"], key=len, reverse=True)
        calls: list[str] = []
        for trigger in triggers:
            tags = [t for t in fmt["tags"] if t["begin"].startswith(trigger)
                    and trigger == next(x for x in triggers if t["begin"].startswith(x))]
            if not tags:
                continue
            body = self.alternatives([self.tag(t, t["begin"][len(trigger):]) for t in tags])
            calls.append(f"{self.rule(f'TAG_TEXT {_lit(trigger)}', '[lazy]')} {body}")
            if trigger in self.special:
                calls.append(f"TAG_TEXT <[{self.special[trigger]}]> {body}")
        call = self.alternatives(calls)
        at_least_one, stop = bool(fmt.get("at_least_one")), bool(fmt.get("stop_after_first"))
        if stop:
            return call if at_least_one else self.rule(f"TAG_TEXT | {call}")
        return self.rule(f"{call}{'+' if at_least_one else '*'} TAG_TEXT")
