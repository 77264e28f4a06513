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
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import xgrammar as xgr

from tandem.structured.backend import (
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    Matcher,
    TiktokenVocab,
    allowed_tokens,
    backend_reason,
    bitmask_words,
    check_structural_tag,
    fill_only,
    popcount,
)
from tandem.structured.compile_worker import CompileWorkerPool, serve

_OBJECT_SCHEMA = '{"type": "object"}'
_COMPACT_SEPARATORS = (",", ":")
WORKER_MEMORY_LIMIT_BYTES = 6 * 2**30  # a compile worker's address space (its normal peak: ~1 GiB virtual)
_MAX_FORCED_CHAIN = 64  # more allowed tokens than this: certainly not a forced position


@dataclass(frozen=True)
class XGrammarCompiled:
    """An xgrammar `CompiledGrammar` plus its memory estimate."""

    handle: Any = field(repr=False)  # xgr.CompiledGrammar
    memory_bytes: int
    backend: str = "xgrammar"


class XGrammarMatcher:
    """One request's `xgr.GrammarMatcher` (unbounded rollback, terminates on an EOS token)."""

    def __init__(self, compiled: XGrammarCompiled, eos_token_ids: Sequence[int], vocab: Sequence[bytes]) -> None:
        """`vocab`: each token id's bytes (the backend's, shared by its matchers)."""
        self._matcher = xgr.GrammarMatcher(compiled.handle, max_rollback_tokens=-1)
        self._eos = list(eos_token_ids)
        self._vocab = vocab
        self._vocab_limit = len(vocab)
        self._scratch = np.zeros((1, bitmask_words(len(vocab))), dtype=np.int32)

    def accept(self, tokens: Sequence[int]) -> int:
        """Accept tokens one by one; a rejected token leaves the matcher where it was."""
        n = 0
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                break
            n += 1
        return n

    def consume(self, tokens: Sequence[int]) -> None:
        n = self.accept(tokens)  # xgrammar checks each token as it accepts it: nothing to save
        if n != len(tokens):
            raise GrammarError("xgrammar", f"token {int(tokens[n])} was sampled but the grammar rejects it")

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

    def forced_tokens(self, limit: int) -> list[int]:
        """At most `limit` tokens along the forced continuation: while the allowed tokens (no EOS among them) are
        all prefixes of the longest one, take the longest. The matcher is rolled back afterwards.

        Not xgrammar's `find_jump_forward_tokens`: it builds the whole forced string with no bound, and on a schema
        whose only documents are infinite (an object that requires itself) it allocated until std::bad_alloc
        (23 GB before the OOM killer, measured). This walk costs one mask fill per step and stops at `limit`."""
        if self._matcher.is_terminated() or limit <= 0:
            return []
        out: list[int] = []
        for _ in range(limit):
            token = self._forced_next()
            if token is None or not self._matcher.accept_token(token):
                break
            out.append(token)
        if out:
            self._matcher.rollback(len(out))
        return out

    def _forced_next(self) -> int | None:
        row = self._scratch  # [1, W]
        self._matcher.fill_next_token_bitmask(row, 0)
        if popcount(row[0]) > _MAX_FORCED_CHAIN:
            return None
        ids = allowed_tokens(row, 0, self._vocab_limit)
        if len(ids) == 0 or any(int(t) in self._eos for t in ids):
            return None
        pieces = [(self._vocab[int(t)], int(t)) for t in ids]
        longest, token = max(pieces, key=lambda p: len(p[0]))
        return token if longest and all(longest.startswith(piece) for piece, _ in pieces) else None

    def validate(self, tokens: Sequence[int]) -> int:
        """Accept as far as possible, then roll the same number back (history is unbounded, so this is exact)."""
        n = self.accept(tokens)
        self.rollback(n)
        return n


class XGrammarBackend:
    """Compiles specs with xgrammar for one vocabulary (its own cache off: the manager caches).

    With `isolated=True` every compile runs in a worker process (`compile_worker.py`) that is killed when it uses
    more than `compile_cpu_limit_s` of CPU: xgrammar builds its token-mask cache eagerly, and some inputs (nested
    bounded repetitions such as `(\\w+\\s?){1,300}`) take minutes, which a thread could never be stopped from.
    """

    name = "xgrammar"
    # 'root ::= root "a" | "b"' after "baa": the mask allows only "a" and EOS, the matcher also takes "aa"
    validates_as_masks = False
    fills_in_batches = False  # a fill holds the GIL: rows go one by one over the manager's fill pool

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        *,
        compile_threads: int = 1,
        isolated: bool = False,
        compile_cpu_limit_s: float = 10.0,
    ) -> None:
        """Build the tokenizer info from a Hugging Face tokenizer; `vocab_size` is the logits width (>= its length)."""
        eos = list(eos_token_ids) or [int(hf_tokenizer.eos_token_id)]
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self._setup(info, vocab_size, eos, compile_threads)
        if isolated:
            self._workers: CompileWorkerPool | None = CompileWorkerPool(
                _compile_worker_main, (info.serialize_json(),), max(1, compile_threads), compile_cpu_limit_s, self.name
            )

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
        self._info = info
        vocab = list(info.decoded_vocab)
        self._vocab_bytes = vocab + [b""] * (vocab_size - len(vocab))  # [V] token id -> bytes
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, compile_threads), cache_enabled=False)
        self._workers = None

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` here, or in a worker process when isolated. Raises GrammarError."""
        if self._workers is not None:
            handle = xgr.CompiledGrammar.deserialize_json(self._workers.run(spec), self._info)
        else:
            handle = compile_spec(self._compiler, spec)
        return XGrammarCompiled(handle=handle, memory_bytes=int(handle.memory_size_bytes))

    def matcher(self, grammar: CompiledGrammar) -> XGrammarMatcher:
        assert isinstance(grammar, XGrammarCompiled), "a grammar compiled by another backend"
        return XGrammarMatcher(grammar, self.eos_token_ids, self._vocab_bytes)

    def prepare_batch(self, work: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> Callable[[], None]:
        rows = list(work)

        def fill() -> None:
            for matcher, row in rows:
                matcher.fill_bitmask(bitmask, row)

        return fill

    def close(self) -> None:
        """Stop the compile workers (if isolated)."""
        if self._workers is not None:
            self._workers.shutdown()


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """`spec` compiled by an `xgr.GrammarCompiler` into an `xgr.CompiledGrammar`; GrammarError with xgrammar's reason."""
    build = _BUILDERS.get(spec.kind)
    if build is None:
        raise GrammarError("xgrammar", f"unsupported kind {spec.kind!r}")
    try:
        return build(compiler, spec)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError with a C++ message
        raise GrammarError("xgrammar", backend_reason(e)) from e


def _compile_schema(compiler: Any, schema: str, whitespace: str) -> Any:
    """compact: no whitespace, separators (',', ':'); flexible: any JSON whitespace between tokens."""
    if whitespace == "compact":
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=_COMPACT_SEPARATORS, strict_mode=False)
    return compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=False)


def _compile_choice(compiler: Any, spec: GrammarSpec) -> Any:
    """root ::= "lit1" | "lit2" | ...; JSON string escapes are valid EBNF string escapes."""
    try:
        literals = spec.choices()
    except ValueError as e:
        raise GrammarError("xgrammar", str(e)) from e
    ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in literals)
    return compiler.compile_grammar(ebnf)


def _compile_structural_tag(compiler: Any, spec: GrammarSpec) -> Any:
    """xgrammar's own structural-tag compiler, after checking that only the shared formats are used."""
    try:
        check_structural_tag(spec.text)
    except ValueError as e:
        raise GrammarError("xgrammar", str(e)) from e
    return compiler.compile_structural_tag(spec.text)


_BUILDERS: dict[str, Callable[[Any, GrammarSpec], Any]] = {
    "json": lambda c, s: _compile_schema(c, s.text, s.whitespace),
    "json_object": lambda c, s: _compile_schema(c, _OBJECT_SCHEMA, s.whitespace),
    "regex": lambda c, s: c.compile_regex(s.text),
    "choice": _compile_choice,
    "grammar": lambda c, s: c.compile_grammar(s.text),
    "structural_tag": _compile_structural_tag,
}


def _compile_worker_main(conn: Connection, tokenizer_info_json: str) -> None:
    """A compile worker process: one single-threaded compiler, answering specs with serialized grammars."""
    serve(conn, _compile_handler, tokenizer_info_json, memory_limit_bytes=WORKER_MEMORY_LIMIT_BYTES)


def _compile_handler(tokenizer_info_json: str) -> Callable[[GrammarSpec], str]:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1, cache_enabled=False)
    return lambda spec: compile_spec(compiler, spec).serialize_json()
