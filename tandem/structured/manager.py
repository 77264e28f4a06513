"""`StructuredOutputManager`: per-request grammar state for the engine, all of it on the host CPU.

Life of a guided request:

    submit(rid, params)   size check at once; cache hit -> ready at once, else a compile job on the compile pool
    poll(rid)             'pending' | 'ready' | 'failed'  (ready: a matcher has been made; failed: error(rid) says why)
    fill_bitmask(...)     each step, for the ready requests of the batch (parallel over chunks on the fill pool)
    fill_draft_bitmasks   speculative steps: one row per draft position, the matcher walks the drafts and rolls back
    accept / rollback / validate_draft / forced_tokens / is_terminated
    release(rid)

Compiled grammars live in a byte-bounded LRU cache keyed by (backend, kind, spec, whitespace). Compile jobs never
touch request state: they only put results into the cache (and rejections into a small negative cache), and the
engine thread picks them up in `poll`. So a compile that outlives `compile_timeout_s` fails only its own request
(the worker thread cannot be killed); when it finishes, its grammar enters the cache under the same byte bound and
no request is half-built.

Two thread pools: compiles on one, mask fills on the other, so a slow compile can never delay a decoding step.
Both libraries release the GIL in their native code, so the pools run truly in parallel with the engine loop.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.params import StructuredOutputsParams
from tandem.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarSpec,
    Matcher,
    allowed_tokens,
    bitmask_words,
    check_bitmask,
)

BACKENDS = ("xgrammar", "llguidance")
AUTO_ORDER = ("xgrammar", "llguidance")  # 'auto': the first that accepts the spec

PENDING, READY, FAILED = "pending", "ready", "failed"
CacheKey = tuple[str, str, str, str]  # (backend, kind, text, whitespace)


@dataclass
class StructuredOutputConfig:
    """Engine-wide settings of the structured-output layer."""

    backend: str = "auto"  # used when a request names none: 'auto' | 'xgrammar' | 'llguidance'
    compile_timeout_s: float = 10.0  # a request still pending this long after submit fails
    max_grammar_bytes: int = 64 * 1024  # larger specs are refused at submit
    cache_bytes: int = 64 * 2**20  # bound on the compiled grammars' memory_bytes in the cache
    num_threads: int = 2  # compile workers; also the parallelism of a large mask fill
    min_rows_per_chunk: int = 8  # fills of fewer than 2x this many rows stay on the calling thread
    rejected_entries: int = 1024  # negative cache (specs a backend rejected), bounded by count
    stats_window: int = 10_000  # durations kept for percentiles

    def __post_init__(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend must be 'auto', 'xgrammar' or 'llguidance', got {self.backend!r}")
        if self.compile_timeout_s <= 0 or self.max_grammar_bytes <= 0 or self.cache_bytes < 0 or self.num_threads < 1:
            raise ValueError(f"invalid structured-output config {self}")


class GrammarCache:
    """An LRU map of compiled grammars bounded by the sum of their `memory_bytes` (thread-safe).

    Invariant: `bytes_used <= capacity` after every call; a grammar larger than the whole capacity is not stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes_used = 0
        self.evictions = 0
        self._entries: OrderedDict[CacheKey, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: CacheKey) -> CompiledGrammar | None:
        """The grammar for `key` (marked most recently used), or None."""
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
            return grammar

    def put(self, key: CacheKey, grammar: CompiledGrammar) -> None:
        """Insert (or refresh) `key`, then evict least recently used entries until within capacity."""
        size = int(grammar.memory_bytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes_used -= int(old.memory_bytes)
            if size > self.capacity:
                return
            self._entries[key] = grammar
            self.bytes_used += size
            while self.bytes_used > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.bytes_used -= int(evicted.memory_bytes)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _Request:
    """One guided request. Only the engine thread reads or writes it."""

    requested: str  # 'auto' | 'xgrammar' | 'llguidance'
    spec: GrammarSpec
    submitted_at: float
    state: str = PENDING
    future: Future[CompiledGrammar] | None = None
    grammar: CompiledGrammar | None = None  # set with state READY (cache hit or finished job)
    matcher: Matcher | None = None
    error: str | None = None


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


class StructuredOutputManager:
    """Compiles, caches and runs the grammars of guided requests; see the module docstring for the life cycle."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: StructuredOutputConfig | None = None,
        *,
        backend_factories: Mapping[str, Callable[[], GrammarBackend]] | None = None,
    ) -> None:
        """Backends are built lazily from `hf_tokenizer` on first use (~0.3 s each); `backend_factories` overrides
        how (e.g. a backend over a raw vocabulary)."""
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._factories: dict[str, Callable[[], GrammarBackend]] = {
            "xgrammar": lambda: _xgrammar(hf_tokenizer, vocab_size, self.eos_token_ids, self.config.num_threads),
            "llguidance": lambda: _llguidance(hf_tokenizer, vocab_size, self.eos_token_ids),
        }
        self._factories.update(backend_factories or {})
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._cache = GrammarCache(self.config.cache_bytes)
        self._rejected: OrderedDict[CacheKey, GrammarError] = OrderedDict()  # why a backend rejected a key
        self._inflight: dict[tuple[str, GrammarSpec], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()  # guards _rejected, _inflight and the counters below
        self._requests: dict[str, _Request] = {}
        # compiles run at the lowest priority: a slow (or hostile) grammar must never take cores from the forward
        self._compile_pool = ThreadPoolExecutor(
            self.config.num_threads, thread_name_prefix="grammar-compile", initializer=_lower_thread_priority
        )
        self._fill_pool = ThreadPoolExecutor(self.config.num_threads, thread_name_prefix="grammar-mask")
        window = self.config.stats_window
        self._compile_s: deque[float] = deque(maxlen=window)
        self._fill_row_s: deque[float] = deque(maxlen=window)
        self._counts = {"compiles": 0, "compile_errors": 0, "cache_hits": 0, "cache_misses": 0, "coalesced": 0,
                        "timeouts": 0, "forced_tokens": 0, "rows_filled": 0}

    # --- submit / poll ------------------------------------------------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Register `request_id`; never blocks on a compile. Raises GrammarError if the spec is over the size limit
        (nothing is registered then) and ValueError if the id is already registered."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already registered")
        spec = GrammarSpec.from_params(params)
        requested = params.backend or self.config.backend
        if spec.size_bytes > self.config.max_grammar_bytes:
            raise GrammarError(requested, f"{spec.kind} spec is {spec.size_bytes} bytes, over the limit of {self.config.max_grammar_bytes}")
        request = _Request(requested=requested, spec=spec, submitted_at=time.monotonic())
        self._requests[request_id] = request
        cached = self._cached(requested, spec)
        if cached is not None:
            self._count("cache_hits")
            request.state, request.grammar = READY, cached
            return
        known = self._known_rejection(requested, spec)
        if known is not None:  # every candidate backend rejected this spec before: fail at once, no compile
            self._count("cache_hits")
            request.state, request.error = FAILED, known
            return
        request.future = self._compile_future(requested, spec)

    def poll(self, request_id: str) -> str:
        """'ready' | 'pending' | 'failed'. Moves a finished compile into the request (making its matcher), and fails
        a request still pending `compile_timeout_s` after submit."""
        request = self._request(request_id)
        if request.state == PENDING and request.future is not None and request.future.done():
            try:
                request.grammar = request.future.result()
                request.state = READY
            except GrammarError as e:
                request.state, request.error = FAILED, str(e)
            except Exception as e:  # a backend that could not be built, or a library bug: fail this request only
                request.state, request.error = FAILED, f"{request.requested}: {type(e).__name__}: {e}"
            request.future = None
        if request.state == PENDING and time.monotonic() - request.submitted_at > self.config.compile_timeout_s:
            self._count("timeouts")
            request.state = FAILED
            request.error = f"{request.requested}: grammar compilation timed out after {self.config.compile_timeout_s:g} s"
            self._abandon(request)
        if request.state == READY and request.matcher is None:
            assert request.grammar is not None
            request.matcher = self.backend(request.grammar.backend).matcher(request.grammar)
        return request.state

    def error(self, request_id: str) -> str | None:
        """Why the request failed ('<backend>: <reason>'), for the user; None unless failed."""
        return self._request(request_id).error

    def backend_of(self, request_id: str) -> str | None:
        """The backend whose grammar serves the request ('auto' resolves to one); None until ready."""
        grammar = self._request(request_id).grammar
        return grammar.backend if grammar is not None else None

    # --- per-step calls (ready requests only) ------------------------------------------------------------------

    def fill_bitmask(self, request_ids: Sequence[str], bitmask: np.ndarray, rows: Sequence[int]) -> None:
        """Overwrite `bitmask[rows[i]]` with the allowed tokens of `request_ids[i]`; other rows are not touched.

        bitmask: int32 [R, ceil(V/32)], C-contiguous. Large batches are split into chunks filled concurrently on
        the fill pool and the calling thread (rows are disjoint, so the writes never overlap).
        """
        if len(request_ids) != len(rows):
            raise ValueError(f"{len(request_ids)} request ids but {len(rows)} rows")
        check_bitmask(bitmask, self.vocab_size)
        if len(set(rows)) != len(rows) or any(not 0 <= r < bitmask.shape[0] for r in rows):
            raise ValueError(f"rows must be distinct and in [0, {bitmask.shape[0]})")
        work = [(self._matcher(rid), int(row)) for rid, row in zip(request_ids, rows, strict=True)]
        chunks = self._chunks(work)
        futures = [self._fill_pool.submit(_fill_chunk, chunk, bitmask) for chunk in chunks[1:]]
        durations = _fill_chunk(chunks[0], bitmask) if chunks else []
        for future in futures:
            durations.extend(future.result())
        with self._lock:
            self._fill_row_s.extend(durations)
            self._counts["rows_filled"] += len(durations)

    def fill_draft_bitmasks(self, request_id: str, draft_tokens: Sequence[int], bitmask: np.ndarray, first_row: int) -> int:
        """Speculative decoding: row first_row + j gets the mask after draft_tokens[:j], j = 0..len(drafts).

        Stops after the row at the first draft token the grammar rejects (later rows are not touched, the target
        cannot accept past it anyway). Returns the number of rows filled. The matcher ends where it started.
        """
        check_bitmask(bitmask, self.vocab_size)
        if first_row < 0 or first_row + len(draft_tokens) >= bitmask.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + len(draft_tokens)} do not fit a bitmask of {bitmask.shape[0]} rows")
        matcher = self._matcher(request_id)
        durations: list[float] = []
        accepted = 0
        for j in range(len(draft_tokens) + 1):
            started = time.perf_counter()
            matcher.fill_bitmask(bitmask, first_row + j)
            durations.append(time.perf_counter() - started)
            if j == len(draft_tokens) or matcher.accept([int(draft_tokens[j])]) != 1:
                break
            accepted += 1
        matcher.rollback(accepted)
        with self._lock:
            self._fill_row_s.extend(durations)
            self._counts["rows_filled"] += len(durations)
        return len(durations)

    def accept(self, request_id: str, tokens: Sequence[int]) -> int:
        """Advance the request's matcher over `tokens`; returns how many were accepted (stops at the first invalid)."""
        return self._matcher(request_id).accept([int(t) for t in tokens])

    def rollback(self, request_id: str, n: int) -> None:
        """Undo the last `n` accepted tokens (rejected draft tokens)."""
        self._matcher(request_id).rollback(int(n))

    def validate_draft(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many leading draft `tokens` the grammar would accept; the matcher is unchanged."""
        return self._matcher(request_id).validate([int(t) for t in tokens])

    def forced_tokens(self, request_id: str) -> list[int]:
        """Tokens the grammar forces next (empty if it allows a choice); the matcher is unchanged."""
        forced = self._matcher(request_id).forced_tokens()
        if forced:
            self._count("forced_tokens", len(forced))
        return forced

    def is_terminated(self, request_id: str) -> bool:
        """True once the request's matcher has accepted EOS."""
        return self._matcher(request_id).is_terminated()

    def allowed_tokens(self, request_id: str) -> np.ndarray:
        """The allowed next token ids of one request (int64 [n]; for debugging and tests, allocates a row)."""
        row = np.zeros((1, bitmask_words(self.vocab_size)), dtype=np.int32)
        self._matcher(request_id).fill_bitmask(row, 0)
        return allowed_tokens(row, 0, self.vocab_size)

    def release(self, request_id: str) -> None:
        """Forget the request (no-op if unknown). A compile still running for it completes into the cache."""
        self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def warm_up(self) -> None:
        """Build the default backend(s) now (about 0.3-1 s each) instead of on the first compile."""
        for name in self._candidates(self.config.backend):
            self.backend(name)

    # --- stats / shutdown -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and percentiles as plain numbers (times in milliseconds / microseconds as named)."""
        with self._lock:
            counts = dict(self._counts)
            compile_s = list(self._compile_s)
            fill_s = list(self._fill_row_s)
        return {
            **{k: float(v) for k, v in counts.items()},
            "compile_ms_p50": 1e3 * _percentile(compile_s, 50),
            "compile_ms_p99": 1e3 * _percentile(compile_s, 99),
            "cache_entries": float(len(self._cache)),
            "cache_bytes": float(self._cache.bytes_used),
            "cache_capacity_bytes": float(self._cache.capacity),
            "cache_evictions": float(self._cache.evictions),
            "mask_fill_us_per_row_p50": 1e6 * _percentile(fill_s, 50),
            "mask_fill_us_per_row_p99": 1e6 * _percentile(fill_s, 99),
            "requests": float(len(self._requests)),
        }

    def compile_durations_s(self) -> list[float]:
        """The recent compile durations (seconds), oldest first."""
        with self._lock:
            return list(self._compile_s)

    def shutdown(self) -> None:
        """Stop both pools (queued compiles are cancelled; running ones are not waited for)."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)

    # --- internals ----------------------------------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown structured-output request {request_id!r}")
        return request

    def _matcher(self, request_id: str) -> Matcher:
        state = self.poll(request_id)
        request = self._requests[request_id]
        if state != READY or request.matcher is None:
            raise RuntimeError(f"structured-output request {request_id!r} is {state}, not ready" + (f": {request.error}" if request.error else ""))
        return request.matcher

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def backend(self, name: str) -> GrammarBackend:
        """The backend called `name`, built on first use (thread-safe)."""
        backend = self._backends.get(name)
        if backend is None:
            with self._backend_lock:
                backend = self._backends.get(name)
                if backend is None:
                    backend = self._factories[name]()
                    if backend.vocab_size != self.vocab_size:
                        raise ValueError(f"backend {name} has vocab_size {backend.vocab_size}, manager {self.vocab_size}")
                    self._backends[name] = backend
        return backend

    @staticmethod
    def _candidates(requested: str) -> tuple[str, ...]:
        return AUTO_ORDER if requested == "auto" else (requested,)

    @staticmethod
    def _key(backend: str, spec: GrammarSpec) -> CacheKey:
        return (backend, spec.kind, spec.text, spec.whitespace)

    def _cached(self, requested: str, spec: GrammarSpec) -> CompiledGrammar | None:
        """A cached grammar from the first candidate backend not known to reject the spec (the one a compile
        would pick), or None."""
        for name in self._candidates(requested):
            key = self._key(name, spec)
            grammar = self._cache.get(key)
            if grammar is not None:
                return grammar
            with self._lock:
                if key not in self._rejected:
                    return None
        return None

    def _known_rejection(self, requested: str, spec: GrammarSpec) -> str | None:
        """The combined message if every candidate backend is known to reject `spec`, else None."""
        with self._lock:
            found = [self._rejected.get(self._key(name, spec)) for name in self._candidates(requested)]
        rejections = [e for e in found if e is not None]
        if len(rejections) < len(found):
            return None
        return str(_combined(requested, rejections))

    def _compile_future(self, requested: str, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The in-flight job for (requested, spec), or a new one."""
        with self._lock:
            future = self._inflight.get((requested, spec))
            if future is not None:
                self._counts["coalesced"] += 1
                return future
            # the job may have finished (and left _inflight) since the caller looked at the cache
            for name in self._candidates(requested):
                hit = self._cache.get(self._key(name, spec))
                if hit is not None:
                    self._counts["cache_hits"] += 1
                    done: Future[CompiledGrammar] = Future()
                    done.set_result(hit)
                    return done
            self._counts["cache_misses"] += 1
            future = self._compile_pool.submit(self._compile_job, requested, spec)
            self._inflight[(requested, spec)] = future
        future.add_done_callback(lambda _f: self._forget_inflight(requested, spec))
        return future

    def _abandon(self, request: _Request) -> None:
        """Detach a timed-out request from its compile; cancel the job if it has not started and nobody else waits.

        A running compile cannot be interrupted: it finishes (at idle priority) and caches its grammar."""
        future, request.future = request.future, None
        if future is None:
            return
        waiting = any(r.future is future for r in self._requests.values())
        if not waiting and future.cancel():
            self._forget_inflight(request.requested, request.spec)

    def _forget_inflight(self, requested: str, spec: GrammarSpec) -> None:
        with self._lock:
            self._inflight.pop((requested, spec), None)

    def _compile_job(self, requested: str, spec: GrammarSpec) -> CompiledGrammar:
        """Runs on a compile worker: try the candidate backends in order; cache the first success, remember each
        rejection. Raises GrammarError with every candidate's reason when all reject."""
        rejections: list[GrammarError] = []
        for name in self._candidates(requested):
            key = self._key(name, spec)
            grammar = self._cache.get(key)
            if grammar is not None:
                return grammar
            with self._lock:
                known = self._rejected.get(key)
            if known is not None:
                rejections.append(known)
                continue
            backend = self.backend(name)
            started = time.perf_counter()
            try:
                grammar = backend.compile(spec)
            except GrammarError as e:
                self._remember_rejection(key, e)
                rejections.append(e)
                continue
            finally:
                self._record_compile(time.perf_counter() - started)
            self._cache.put(key, grammar)
            return grammar
        raise _combined(requested, rejections)

    def _remember_rejection(self, key: CacheKey, error: GrammarError) -> None:
        with self._lock:
            self._counts["compile_errors"] += 1
            self._rejected[key] = error
            self._rejected.move_to_end(key)
            while len(self._rejected) > self.config.rejected_entries:
                self._rejected.popitem(last=False)

    def _record_compile(self, seconds: float) -> None:
        with self._lock:
            self._counts["compiles"] += 1
            self._compile_s.append(seconds)

    def _chunks(self, work: list[tuple[Matcher, int]]) -> list[list[tuple[Matcher, int]]]:
        """Split the rows into at most num_threads chunks of >= min_rows_per_chunk rows (one chunk when small)."""
        n_chunks = max(1, min(self.config.num_threads, len(work) // self.config.min_rows_per_chunk))
        size = -(-len(work) // n_chunks) if work else 0
        return [work[i : i + size] for i in range(0, len(work), size)] if work else []


def _lower_thread_priority() -> None:
    """Nice 19 for the calling thread (Linux: priorities are per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _combined(requested: str, rejections: Sequence[GrammarError]) -> GrammarError:
    """One backend's rejection as is; several as 'auto: xgrammar: ...; llguidance: ...'."""
    if len(rejections) == 1:  # a fresh exception: the stored one must not collect tracebacks
        return GrammarError(rejections[0].backend, rejections[0].reason)
    return GrammarError(requested, "; ".join(str(e) for e in rejections))


def _fill_chunk(chunk: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> list[float]:
    """Fill one chunk's rows; returns each row's fill time in seconds."""
    durations = []
    for matcher, row in chunk:
        started = time.perf_counter()
        matcher.fill_bitmask(bitmask, row)
        durations.append(time.perf_counter() - started)
    return durations


def _xgrammar(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int], threads: int) -> GrammarBackend:
    from tandem.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(hf_tokenizer, vocab_size, eos, compile_threads=threads)


def _llguidance(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> GrammarBackend:
    from tandem.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(hf_tokenizer, vocab_size, eos)


def measure_mask_fill(
    backend: GrammarBackend,
    spec: GrammarSpec,
    *,
    tokens: Sequence[int] | None = None,
    steps: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """Time `fill_bitmask` per row for one grammar on `backend`'s vocabulary.

    With `tokens` (a valid output's tokens), the matcher walks them and a mask is filled before each one; without,
    it walks `steps` random allowed tokens (a random-logits model), restarting when it terminates. Returns rows,
    compile_ms and the per-row p50 / p99 / mean in microseconds.
    """
    started = time.perf_counter()
    grammar = backend.compile(spec)
    compile_ms = 1e3 * (time.perf_counter() - started)
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, bitmask_words(backend.vocab_size)), dtype=np.int32)  # [1, W]
    matcher = backend.matcher(grammar)
    path = list(tokens) if tokens is not None else None
    durations: list[float] = []
    for step in range(len(path) if path is not None else steps):
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        durations.append(time.perf_counter() - t0)
        if path is not None:
            token = path[step]
        else:
            allowed = allowed_tokens(bitmask, 0, backend.vocab_size)
            token = int(rng.choice(allowed))
        if matcher.accept([token]) != 1:
            raise ValueError(f"token {token} at step {step} was not accepted")
        if matcher.is_terminated():
            matcher = backend.matcher(grammar)
    return {
        "rows": float(len(durations)),
        "compile_ms": compile_ms,
        "fill_us_p50": 1e6 * _percentile(durations, 50),
        "fill_us_p99": 1e6 * _percentile(durations, 99),
        "fill_us_mean": 1e6 * float(np.mean(durations)) if durations else 0.0,
    }
