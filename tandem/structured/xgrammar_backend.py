"""xgrammar backend: JSON schema, any JSON object, regex, choice, GBNF (xgrammar's EBNF dialect) and structural tags.

xgrammar precomputes, per grammar, which tokens each parser position can take (the adaptive token-mask cache), so
compiles are slow-ish (10 ms - 1 s) and mask fills are fast. Its C++ calls release the GIL (tvm-ffi releases it
by default), so compiles and fills on worker threads run in parallel with the engine loop.

Choices made here:
- JSON schemas compile with `strict_mode=False`: keywords mean what JSON Schema says (objects without
  `additionalProperties: false` admit extra keys), matching the llguidance backend and the conformance suite.
- Keywords xgrammar does not implement (`not`, `if`/`then`, `uniqueItems`, ...) are ignored by xgrammar, not
  rejected; docs/structured_conformance.md counts the resulting false accepts.
- Lark grammars are not accepted here (the 'grammar' kind is GBNF); 'auto' falls back to llguidance for them.
- Structural tags are limited to the formats both backends compile (STRUCTURAL_TAG_FORMATS), so a request's
  meaning never depends on which backend `auto` picked. xgrammar builds their token masks lazily: a tool set's
  trigger grammar compiles in ~10 ms on a 49k vocabulary where the same schemas as a plain JSON grammar take longer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xgrammar as xgr

from tandem.structured.backend import (
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    TiktokenVocab,
    backend_reason,
    check_structural_tag,
    fill_only,
)

_OBJECT_SCHEMA = '{"type": "object"}'
_COMPACT_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class XGrammarCompiled:
    """An xgrammar `CompiledGrammar` plus its memory estimate."""

    handle: Any = field(repr=False)  # xgr.CompiledGrammar
    memory_bytes: int
    backend: str = "xgrammar"


class XGrammarMatcher:
    """One request's `xgr.GrammarMatcher` (unbounded rollback, terminates on an EOS token)."""

    def __init__(self, compiled: XGrammarCompiled, eos_token_ids: Sequence[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled.handle, max_rollback_tokens=-1)
        self._eos = list(eos_token_ids)

    def accept(self, tokens: Sequence[int]) -> int:
        """Accept tokens one by one; a rejected token leaves the matcher where it was."""
        n = 0
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                break
            n += 1
        return n

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._matcher.is_terminated():
            fill_only(bitmask, row, self._eos)  # xgrammar refuses to fill after EOS; keep the row well-defined
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        if n > 0:
            self._matcher.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def forced_tokens(self) -> list[int]:
        if self._matcher.is_terminated():
            return []
        return [int(t) for t in self._matcher.find_jump_forward_tokens()]

    def validate(self, tokens: Sequence[int]) -> int:
        """Accept as far as possible, then roll the same number back (history is unbounded, so this is exact)."""
        n = self.accept(tokens)
        self.rollback(n)
        return n


class XGrammarBackend:
    """Compiles specs with one `xgr.GrammarCompiler` for one vocabulary (its own cache off: the manager caches)."""

    name = "xgrammar"

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        *,
        compile_threads: int = 1,
    ) -> None:
        """Build the tokenizer info from a Hugging Face tokenizer; `vocab_size` is the logits width (>= its length)."""
        eos = list(eos_token_ids) or [int(hf_tokenizer.eos_token_id)]
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self._setup(info, vocab_size, eos, compile_threads)

    @classmethod
    def from_tiktoken(
        cls, vocab: TiktokenVocab, vocab_size: int | None = None, eos_token_ids: Sequence[int] = (), *, compile_threads: int = 1
    ) -> XGrammarBackend:
        """A backend over a raw tiktoken vocabulary (special tokens and gaps are never allowed, except EOS)."""
        size = vocab_size or vocab.size
        eos = list(eos_token_ids) or [vocab.eos_token_id]
        info = xgr.TokenizerInfo(vocab.token_bytes(), xgr.VocabType.RAW, vocab_size=size, stop_token_ids=eos)
        self = cls.__new__(cls)
        self._setup(info, size, eos, compile_threads)
        return self

    def _setup(self, info: Any, vocab_size: int, eos: list[int], compile_threads: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, compile_threads), cache_enabled=False)
        self._compilers: dict[str, Callable[[GrammarSpec], Any]] = {
            "json": self._compile_json,
            "json_object": self._compile_json_object,
            "regex": lambda s: self._compiler.compile_regex(s.text),
            "choice": self._compile_choice,
            "grammar": lambda s: self._compiler.compile_grammar(s.text),
            "structural_tag": self._compile_structural_tag,
        }

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        build = self._compilers.get(spec.kind)
        if build is None:
            raise GrammarError(self.name, f"unsupported kind {spec.kind!r}")
        try:
            handle = build(spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError with a C++ message
            raise GrammarError(self.name, backend_reason(e)) from e
        return XGrammarCompiled(handle=handle, memory_bytes=int(handle.memory_size_bytes))

    def matcher(self, grammar: CompiledGrammar) -> XGrammarMatcher:
        assert isinstance(grammar, XGrammarCompiled), "a grammar compiled by another backend"
        return XGrammarMatcher(grammar, self.eos_token_ids)

    def _compile_json(self, spec: GrammarSpec) -> Any:
        return self._compile_schema(spec.text, spec.whitespace)

    def _compile_json_object(self, spec: GrammarSpec) -> Any:
        return self._compile_schema(_OBJECT_SCHEMA, spec.whitespace)

    def _compile_schema(self, schema: str, whitespace: str) -> Any:
        """compact: no whitespace, separators (',', ':'); flexible: any JSON whitespace between tokens."""
        if whitespace == "compact":
            return self._compiler.compile_json_schema(
                schema, any_whitespace=False, separators=_COMPACT_SEPARATORS, strict_mode=False
            )
        return self._compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=False)

    def _compile_structural_tag(self, spec: GrammarSpec) -> Any:
        """xgrammar's own structural-tag compiler, after checking that only the shared formats are used."""
        try:
            check_structural_tag(spec.text)
        except ValueError as e:
            raise GrammarError(self.name, str(e)) from e
        return self._compiler.compile_structural_tag(spec.text)

    def _compile_choice(self, spec: GrammarSpec) -> Any:
        """root ::= "lit1" | "lit2" | ...; JSON string escapes are valid EBNF string escapes."""
        try:
            literals = spec.choices()
        except ValueError as e:
            raise GrammarError(self.name, str(e)) from e
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in literals)
        return self._compiler.compile_grammar(ebnf)
