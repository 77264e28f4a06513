"""`StructuredOutputManager`: per-request grammar state for the engine, all of it on the host CPU.

Life of a guided request:

    submit(rid, params)   size check; route to a backend (routing.py); cache hit -> ready at once, else a compile
                          job (GrammarQueueFull when too many distinct grammars already wait: the caller says 429)
    poll(rid)             'pending' | 'ready' | 'failed'  (ready: a matcher has been made; failed: error(rid) says why)
    fill_bitmask(...)     each step, for the ready requests of the batch: in one call per backend that fills in
                          batches (llguidance, on its own threads), one by one over the fill pool otherwise;
                          returns the requests whose fill failed, so the engine ends those alone
    fill_draft_bitmasks   speculative steps: one row per draft position, the matcher walks the drafts and rolls back
    accept / rollback / validate_draft / forced_tokens / is_terminated
    release(rid)

Compiled grammars live in a byte-bounded LRU cache keyed by (backend, kind, text, whitespace). Compile jobs never
touch request state: they only put results into the cache (and rejections into a small negative cache), and the
engine thread picks them up in `poll`.

Hostile input: a compile may use at most `compile_timeout_s` of its own CPU time (time spent queued or preempted
does not count). llguidance compiles run on the compile threads (they take ~1 ms and llguidance bounds its own
work); xgrammar compiles run in worker processes that are killed at the limit (compile_worker.py). A mask fill that
fails ends only its request; one slower than `max_fill_ms` moves its request to llguidance (replaying the tokens it
accepted), or ends it when that is impossible.

Three thread pools: compiles on one, mask fills on another, so a slow compile can never delay a decoding step, and
the workers of rows filled in the forward's slack (slack_fill.py), which hold their threads until its deadline.
A batched fill runs on llguidance's threads with the GIL released once for the whole step; the rows filled one by
one (xgrammar's, and each request's timed fills: `TIMED_FILL_EVERY`) go over the fill pool meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.params import StructuredOutputsParams
from tandem.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarQueueFull,
    GrammarSpec,
    Matcher,
    allowed_tokens,
    bitmask_words,
    check_bitmask,
    fill_only,
)
from tandem.structured.cache import CacheKey, GrammarCache
from tandem.structured.measure import percentile
from tandem.structured.routing import BackendRouter, Route, TextKey
from tandem.structured.slack_fill import RowClock, SlackFill

logger = logging.getLogger("tandem")
BACKENDS = ("xgrammar", "llguidance")
# A request's fills go in batches, where no row has a time of its own; one in this many is filled alone and timed:
# the backend router's per-grammar mean, the fill percentiles and the `max_fill_ms` guard see those. A timed row
# holds the engine thread (and the GIL) while it fills: at 1 in 16, 256 guided requests over o200k spent 2 ms a
# step on them in `tandem bench simulated`
TIMED_FILL_EVERY = 64
PENDING, READY, FAILED = "pending", "ready", "failed"
# the longest `start_fill` waits for a fill-pool thread to begin a batch (its threads are free at a step's start)
HANDOFF_WAIT_S = 0.002


@dataclass
class StructuredOutputConfig:
    """Engine-wide settings of the structured-output layer."""

    backend: str = "auto"  # used when a request names none: 'auto' (by cost, see routing.py) | 'xgrammar' | 'llguidance'
    compile_timeout_s: float = 10.0  # CPU seconds one compile may use (its own: time queued does not count)
    max_grammar_bytes: int = 64 * 1024  # larger schemas / regexes / grammars are refused at submit
    cache_bytes: int = 64 * 2**20  # bound on the compiled grammars' memory_bytes in the cache
    num_threads: int = 2  # compile threads (and xgrammar worker processes); also the parallelism of a large mask fill
    max_queued_compiles: int = 256  # distinct grammars waiting for or in compilation; beyond: GrammarQueueFull
    min_rows_per_chunk: int = 8  # fills of fewer than 2x this many rows stay on the calling thread
    rejected_entries: int = 1024  # negative cache (specs a backend rejected), bounded by count
    stats_window: int = 10_000  # durations kept for percentiles
    promote_after: int = 4  # auto: a grammar asked for this often also gets xgrammar's precompiled masks (0: never)
    max_fill_ms: float = 100.0  # a mask fill using more CPU time than this moves its request to llguidance, or ends it
    isolate_compiles: bool = True  # xgrammar compiles in worker processes that are killed at compile_timeout_s
    unmasked_greedy: bool = True  # greedy rows in free-text states skip their mask fill, their token checked after
    unmasked_min_fill_ms: float = 0.1  # ... if that fill cost this much CPU (structural JSON states: ~0.05 ms)
    # vLLM's engine-wide switch: every guided request's grammar holds its thinking too (with a reasoning parser), as
    # StructuredOutputsParams(enable_in_reasoning=True) does for one request (see SamplingParams.grammar_in_reasoning)
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        """ValueError naming the first setting of the wrong type (e.g. the string "false" for a flag) or range."""
        for f in dataclasses.fields(self):
            value, want = getattr(self, f.name), type(f.default)
            if not _of_type(value, want):
                raise ValueError(f"{f.name} must be a{'n' if want is int else ''} {want.__name__}, got {value!r}")
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend must be 'auto', 'xgrammar' or 'llguidance', got {self.backend!r}")
        positive = ("compile_timeout_s", "max_grammar_bytes", "num_threads", "max_queued_compiles", "max_fill_ms",
                    "min_rows_per_chunk")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("cache_bytes", "promote_after", "unmasked_min_fill_ms", "rejected_entries", "stats_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


def _of_type(value: Any, want: type) -> bool:
    """`value` fits a setting whose default is of type `want`: a float setting takes an int, no number takes a bool."""
    if want in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, want) or (want is float and isinstance(value, int))


class _JobClock:
    """The CPU clock of the thread running one compile job (read from the engine's thread)."""

    def __init__(self) -> None:
        self._clock: int | None = None
        self._start = 0.0

    def begin(self) -> None:
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._start = time.clock_gettime(self._clock)

    def cpu_seconds(self) -> float:
        return 0.0 if self._clock is None else time.clock_gettime(self._clock) - self._start

    def exclude(self, work: Callable[[], Any]) -> Any:
        """Run `work` without counting its CPU time (building a backend is not the compile's cost)."""
        before = self.cpu_seconds()
        try:
            return work()
        finally:
            self._start += self.cpu_seconds() - before


@dataclass(eq=False)
class _Job:
    """One compile on the pool, shared by every request waiting for the same (route, spec)."""

    future: Future[CompiledGrammar]
    clock: _JobClock


@dataclass
class _Request:
    """One guided request. Only the engine thread reads or writes it."""

    requested: str  # 'auto' | 'xgrammar' | 'llguidance'
    spec: GrammarSpec
    route: Route
    state: str = PENDING
    job: _Job | None = None
    grammar: CompiledGrammar | None = None  # set with state READY (cache hit or finished job)
    matcher: Matcher | None = None
    error: str | None = None
    reason: str | None = None  # why its backend serves it
    tokens: list[int] = field(default_factory=list)  # accepted so far (replayed when it moves to another backend)
    open_mask: bool = False  # its last plain mask allowed OPEN_MASK_FRACTION of the vocabulary (and, alone, was costly)
    untimed_fills: int = 0  # batched fills since its last timed one

    @property
    def text_key(self) -> TextKey:
        return (self.spec.kind, self.spec.text, self.spec.whitespace)


_Work = tuple[str, Matcher, int, Sequence[int]]  # (request id, matcher, bitmask row, probe tokens: see fill_or_skip)
# (request id, seconds, CPU seconds of the filling thread or UNTIMED (filled in a batch), error, estimated fraction of
# the vocabulary allowed, or SKIPPED: the probe tokens were allowed, the row was left as it was)
_Filled = tuple[str, float, float, str | None, float]
SKIPPED = -1.0
UNTIMED = -1.0
OPEN_MASK_FRACTION = 0.2  # a mask allowing this much of the vocabulary marks a state of free text (inside a string)
# the allowed fraction is estimated from one 64-byte cache line (16 words) in every 8 of a row: a strided read of
# single words touches every line anyway (256 rows over o200k: 2 ms a step on the engine thread, 0.3 ms this way)
_LINE_WORDS = 16
_DENSITY_LINES = 8


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
        self.config = cfg = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._factories: dict[str, Callable[[], GrammarBackend]] = {
            "xgrammar": lambda: _xgrammar(hf_tokenizer, vocab_size, self.eos_token_ids, cfg),
            "llguidance": lambda: _llguidance(hf_tokenizer, vocab_size, self.eos_token_ids, cfg),
        }
        self._factories.update(backend_factories or {})
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._cache = GrammarCache(cfg.cache_bytes)
        self._router = BackendRouter(cfg.promote_after)
        self._rejected: OrderedDict[CacheKey, GrammarError] = OrderedDict()  # why a backend rejected a key
        self._inflight: dict[tuple[tuple[str, ...], GrammarSpec], _Job] = {}
        self._lock = threading.Lock()  # guards _rejected, _inflight and the counters below
        self._requests: dict[str, _Request] = {}
        self._compile_pool = ThreadPoolExecutor(cfg.num_threads, thread_name_prefix="grammar-compile")
        # compiles registered but not yet on the pool (`hold_compiles`): (its job's future, backends, spec, clock)
        self._held: list[tuple[Future[CompiledGrammar], tuple[str, ...], GrammarSpec, _JobClock]] | None = None
        # two at least: a step's batch may be filling in one while the rows a step sampled late are refilled
        self._fill_pool = ThreadPoolExecutor(max(2, cfg.num_threads), thread_name_prefix="grammar-mask")
        # slack rows' workers hold their threads until the forward's deadline: never in the way of the fills above
        self._slack_pool = ThreadPoolExecutor(cfg.num_threads, thread_name_prefix="grammar-slack")
        self._slack_clock = RowClock()
        self._compile_s: dict[str, deque[float]] = {b: deque(maxlen=cfg.stats_window) for b in BACKENDS}
        self._fill_row_s: deque[float] = deque(maxlen=cfg.stats_window)
        self._running = 0  # compile jobs running now
        self._counts = {k: 0 for k in (
            "compiles", "compile_errors", "cache_hits", "cache_misses", "coalesced", "timeouts", "forced_tokens",
            "rows_filled", "slack_fills", "queue_full", "fill_errors", "slow_fills", "switches", "promotions", "fallbacks",
            "served_xgrammar", "served_llguidance")}

    # --- submit / poll ------------------------------------------------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Register `request_id`; never blocks on a compile. Nothing is registered when it raises: GrammarError if
        the spec is over the size limit, GrammarQueueFull if too many compiles wait, ValueError for a duplicate id."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already registered")
        spec = GrammarSpec.from_params(params)
        requested = params.backend or self.config.backend
        if spec.size_bytes > self.config.max_grammar_bytes:
            raise GrammarError(requested, f"{spec.kind} is {spec.size_bytes} bytes, over the limit of {self.config.max_grammar_bytes}")
        route = self._router.route(requested, (spec.kind, spec.text, spec.whitespace),
                                   lambda b: self._cache.get(_key(b, spec)) is not None)
        request = _Request(requested=requested, spec=spec, route=route)
        cached = self._cached(route, spec)
        if cached is not None:
            self._count("cache_hits")
            request.state, request.grammar = READY, cached
        elif (known := self._known_rejection(route, spec)) is not None:  # every candidate rejected it before
            self._count("cache_hits")
            request.state, request.error = FAILED, known
        else:
            request.job = self._compile_job(route.backends, spec)
        self._requests[request_id] = request
        self._maybe_promote(request)

    def poll(self, request_id: str) -> str:
        """'ready' | 'pending' | 'failed'. Moves a finished compile into the request (making its matcher), and fails
        a request whose compile has used `compile_timeout_s` of CPU time."""
        request = self._request(request_id)
        job = request.job
        if request.state == PENDING and job is not None and job.future.done():
            request.job = None
            try:
                request.grammar = job.future.result()
                request.state = READY
            except GrammarError as e:
                request.state, request.error = FAILED, str(e)
            except Exception as e:  # a backend that could not be built, or a library bug: fail this request only
                request.state, request.error = FAILED, f"{request.requested}: {type(e).__name__}: {e}"
        elif request.state == PENDING and job is not None and job.clock.cpu_seconds() > self.config.compile_timeout_s:
            self._count("timeouts")
            request.state = FAILED
            request.error = (f"{request.route.backends[0]}: grammar compilation timed out "
                             f"(used more than {self.config.compile_timeout_s:g} s of CPU time)")
            self._abandon(request)
        if request.state == READY and request.matcher is None:
            self._make_matcher(request)
        return request.state

    def _make_matcher(self, request: _Request) -> None:
        grammar = request.grammar
        assert grammar is not None
        try:
            request.matcher = self.backend(grammar.backend).matcher(grammar)
        except Exception as e:  # noqa: BLE001 - a library failure on one grammar fails that request alone
            request.state, request.error = FAILED, f"{grammar.backend}: cannot start a matcher: {type(e).__name__}: {e}"
            return
        first = request.route.backends[0]
        if grammar.backend == first:
            request.reason = request.route.reason
        else:
            self._count("fallbacks")
            with self._lock:
                why = self._rejected.get(_key(first, request.spec))
            request.reason = f"{grammar.backend}: fallback, {first} rejected it ({why.reason if why else 'unknown'})"
        self._count(f"served_{grammar.backend}")

    def error(self, request_id: str) -> str | None:
        """Why the request failed ('<backend>: <reason>'), for the user; None unless failed."""
        return self._request(request_id).error

    def backend_of(self, request_id: str) -> str | None:
        """The backend whose grammar serves the request ('auto' resolves to one); None until ready."""
        grammar = self._request(request_id).grammar
        return grammar.backend if grammar is not None else None

    def reason_of(self, request_id: str) -> str | None:
        """Why that backend serves the request (routing by cost, a fallback, a move after a slow fill)."""
        return self._request(request_id).reason

    def hold_compiles(self) -> None:
        """From now on a new compile job waits for `start_compiles` before it runs; its request is registered,
        counted against the queue and coalesced with others at `submit` as before. For an engine beside an
        accelerator: a burst of new grammars then compiles beside the forward it launches, not while the requests
        are admitted, where the compile threads took the GIL and this manager's lock from each admission (256
        requests of distinct schemas: their first forward launched 17.8 ms after the burst's arrival instead of
        26.4, medians of 9 alternating runs of `tandem bench simulated --step-ms 20 --logits replay --concurrency
        256 --modes guided+suffix`, AMD EPYC Zen 4, 2026-12-06)."""
        with self._lock:
            if self._held is None:
                self._held = []

    def start_compiles(self) -> None:
        """Put the compile jobs held since the last call on the compile threads (in the order they came)."""
        with self._lock:
            held, self._held = self._held, ([] if self._held is not None else None)
        for future, backends, spec, clock in held or ():
            self._compile_pool.submit(self._run_held, future, backends, spec, clock)

    @property
    def num_compiling(self) -> int:
        """Compile jobs running right now (the engine gives them cores from the forward's share)."""
        with self._lock:
            return self._running

    # --- per-step calls (ready requests only) ------------------------------------------------------------------

    def fill_bitmask(self, request_ids: Sequence[str], bitmask: np.ndarray, rows: Sequence[int],
                     min_rows_per_chunk: int | None = None, in_batches: bool = True) -> dict[str, str]:
        """Overwrite `bitmask[rows[i]]` with the allowed tokens of `request_ids[i]`; other rows are not touched.

        bitmask: int32 [R, ceil(V/32)], C-contiguous. Large batches are split into chunks filled concurrently on
        the fill pool and the calling thread (rows are disjoint, so the writes never overlap). Returns
        {request id: reason} for the requests whose fill failed (their rows then allow only EOS); the manager has
        nothing more to do for them but `release`. `in_batches=False`: every row filled alone, none in a library
        batch call (which would queue behind a batch already filling, e.g. the next step's).
        """
        return self.start_fill(request_ids, bitmask, rows, min_rows_per_chunk, in_batches=in_batches).result()[0]

    def fill_or_skip(self, request_ids: Sequence[str], bitmask: np.ndarray, rows: Sequence[int],
                     min_rows_per_chunk: int | None = None, probe: Mapping[str, Sequence[int]] | None = None,
                     ) -> tuple[dict[str, str], list[str]]:
        """`fill_bitmask`, except that a request in `probe` whose grammar accepts each of its probe tokens next
        (plain letters: a state of free text, where fills over a large vocabulary cost 0.3-2 ms and a model's own choice is
        most likely allowed) keeps its row untouched. Returns (failures, the requests skipped so)."""
        return self.start_fill(request_ids, bitmask, rows, min_rows_per_chunk, probe).result()

    def start_fill(self, request_ids: Sequence[str], bitmask: np.ndarray, rows: Sequence[int],
                   min_rows_per_chunk: int | None = None, probe: Mapping[str, Sequence[int]] | None = None,
                   in_batches: bool = True, slack: Slack | None = None) -> PendingFill:
        """`fill_or_skip`, returning while the batched rows are still being filled on llguidance's threads (the
        probes and the rows filled one by one are done when it returns). Until `result()`, the matchers of
        `request_ids` (and of `slack`) must not be used, and `bitmask` must be neither read nor freed.

        `slack`: rows that may stay untouched (free text); they, and the rows whose probe passed, are filled after
        the others while each is expected to finish before `slack.deadline` (slack_fill.py), on the threads of
        a backend that fills in batches; `result()` reports those not reached as skipped."""
        slack_ids, slack_rows = (slack.request_ids, slack.rows) if slack is not None else ((), ())
        for ids, rws in ((request_ids, rows), (slack_ids, slack_rows)):
            if len(ids) != len(rws):
                raise ValueError(f"{len(ids)} request ids but {len(rws)} rows")
        check_bitmask(bitmask, self.vocab_size)
        every_row = [*rows, *slack_rows]
        if len(set(every_row)) != len(every_row) or any(not 0 <= r < bitmask.shape[0] for r in every_row):
            raise ValueError(f"rows must be distinct and in [0, {bitmask.shape[0]})")
        probe = probe or {}
        work = [(rid, self._matcher(rid), int(row), probe.get(rid, ())) for rid, row in zip(request_ids, rows, strict=True)]
        batched, alone = self._batches(work, in_batches)
        pending = PendingFill(self, bitmask)
        for backend, batch in batched.items():
            fill = self._probe(batch, bitmask, pending.done)
            if fill:
                pending.batches.append((backend, fill, self._submit_batch(backend, fill, bitmask)))
        threads = max(1, min(self.config.num_threads, len(alone) // (min_rows_per_chunk or self.config.min_rows_per_chunk)))
        queue = _RowQueue(alone, bitmask, self.eos_token_ids, self.config.unmasked_min_fill_ms / 1e3)
        futures = [self._fill_pool.submit(queue.drain) for _ in range(threads - 1)] if alone else []
        pending.done.extend(queue.drain())
        for future in futures:
            pending.done.extend(future.result())
        if slack is not None:
            self._start_slack(slack, work, bitmask, pending)
        return pending

    def _start_slack(self, slack: Slack, work: list[_Work], bitmask: np.ndarray, pending: PendingFill) -> None:
        """Fill `slack`'s rows and those whose probe passed while the forward runs (after the step's batches):
        each counts as skipped until a slack worker has filled it."""
        probed = {r[0] for r in pending.done if r[4] == SKIPPED}
        rows = [w for w in work if w[0] in probed] + [(rid, self._matcher(rid), int(row), ())
                                                      for rid, row in zip(slack.request_ids, slack.rows, strict=True)]
        pending.done.extend((rid, 0.0, 0.0, None, SKIPPED) for rid in slack.request_ids)
        fillable = []
        for w in rows:
            grammar = self._requests[w[0]].grammar
            assert grammar is not None
            if self.backend(grammar.backend).fills_in_batches:  # (a fill of the others holds the GIL)
                fillable.append((grammar.backend, w))
        if fillable:
            fill = SlackFill(fillable, lambda bw: self._fill_slack_row(*bw, bitmask), slack.deadline,
                             self._slack_clock, [f for _, _, f in pending.batches])
            if slack.ends_with is not None:
                slack.ends_with.add_done_callback(lambda _: fill.stop())  # (at once if it is done already)
            fill.start(self._slack_pool.submit, self.config.num_threads)
            pending.slack = fill

    def _fill_slack_row(self, backend: str, w: _Work, bitmask: np.ndarray) -> list[_Filled]:
        """One slack row in a library call of its own (GIL released); a failure is its result, as in a batch."""
        try:
            seconds: float | None = self._run_batch(backend, [w], bitmask)
        except Exception:  # noqa: BLE001 - filled alone again by _settle_batch, which reports the error
            seconds = None
        return self._settle_batch([w], bitmask, seconds)

    def _batches(self, work: list[_Work], in_batches: bool = True) -> tuple[dict[str, list[_Work]], list[_Work]]:
        """Split a fill: {backend: rows} for backends that fill in batches, and the rows filled one by one (other
        backends, each request's timed fill, and all rows when not `in_batches`)."""
        batched: dict[str, list[_Work]] = {}
        alone: list[_Work] = []
        for w in work:
            request = self._requests[w[0]]
            assert request.grammar is not None
            name = request.grammar.backend
            if in_batches and self.backend(name).fills_in_batches and request.untimed_fills < TIMED_FILL_EVERY - 1:
                request.untimed_fills += 1
                batched.setdefault(name, []).append(w)
            else:
                request.untimed_fills = 0
                alone.append(w)
        return batched, alone

    def _probe(self, work: list[_Work], bitmask: np.ndarray, done: list[_Filled]) -> list[_Work]:
        """Run the probes of a batch's rows (this thread): a row whose probe passes is SKIPPED, one whose probe
        raises is filled alone (which reports the error); both go to `done`. Returns the rows left to fill."""
        fill: list[_Work] = []
        for w in work:
            try:
                passed = bool(w[3]) and _probe_passes(w[1], w[3])
            except Exception:  # noqa: BLE001 - reported by the fill alone
                done.extend(_fill_chunk([w], bitmask, self.eos_token_ids, self.config.unmasked_min_fill_ms / 1e3))
                continue
            if passed:
                done.append((w[0], 0.0, 0.0, None, SKIPPED))
            else:
                fill.append(w)
        return fill

    def _submit_batch(self, backend: str, work: list[_Work], bitmask: np.ndarray) -> Future[float]:
        """One library call filling `work` on a fill-pool thread (its Python prepared here); returns once that
        thread has begun it, the GIL handed over: the pool's thread needs the GIL to start, and while this thread
        runs Python it gets it only at the interpreter's switch interval (5 ms). Measured, 256 guided requests
        beside a simulated 20 ms forward (AMD EPYC, 2 cores): a step's batch began 8.5 ms (median) after the
        launch though it was submitted ~5 ms after it (8-19 ms in the steps where the device then waited for it).
        The future's result is the call's wall seconds; a failure to prepare is its exception."""
        future: Future[float]
        try:
            call = self.backend(backend).prepare_batch([(w[1], w[2]) for w in work], bitmask)
        except Exception as e:  # noqa: BLE001 - reported by `_settle_batch`, which fills the rows one by one
            future = Future()
            future.set_exception(e)
            return future
        begun = threading.Event()
        future = self._fill_pool.submit(_timed_call, call, begun)
        begun.wait(HANDOFF_WAIT_S)
        return future

    def _run_batch(self, backend: str, work: list[_Work], bitmask: np.ndarray) -> float:
        """One library call filling `work` on this thread (the GIL released inside where the library allows); its
        wall seconds."""
        return _timed_call(self.backend(backend).prepare_batch([(w[1], w[2]) for w in work], bitmask))

    def _settle_batch(self, work: list[_Work], bitmask: np.ndarray, seconds: float | None) -> list[_Filled]:
        """UNTIMED results of a batch that took `seconds`, or, when it raised (None), its rows filled one by one,
        each failing alone. A batch over `max_fill_ms` makes the next fill of each of its requests a timed one,
        which finds the slow grammar."""
        if seconds is None:
            return _fill_chunk([(*w[:3], ()) for w in work], bitmask, self.eos_token_ids, 0.0)
        if seconds * 1e3 > self.config.max_fill_ms:
            for w in work:
                request = self._requests.get(w[0])
                if request is not None:
                    request.untimed_fills = TIMED_FILL_EVERY
        fractions = _allowed_fractions(bitmask, [w[2] for w in work])
        share = seconds / len(work)
        return [(w[0], share, UNTIMED, None, float(f)) for w, f in zip(work, fractions, strict=True)]

    def fill_draft_bitmasks(self, request_id: str, draft_tokens: Sequence[int], bitmask: np.ndarray, first_row: int) -> int:
        """Speculative decoding: row first_row + j gets the mask after draft_tokens[:j], j = 0..len(drafts).

        Stops after the row at the first draft token the grammar rejects (later rows are not touched, the target
        cannot accept past it anyway). Returns the number of rows filled. The matcher ends where it started.
        Raises on a failure inside the grammar library (the caller ends that request).
        """
        check_bitmask(bitmask, self.vocab_size)
        if first_row < 0 or first_row + len(draft_tokens) >= bitmask.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + len(draft_tokens)} do not fit a bitmask of {bitmask.shape[0]} rows")
        matcher = self._matcher(request_id)
        results: list[_Filled] = []
        accepted = 0
        try:
            for j in range(len(draft_tokens) + 1):
                started, cpu = time.perf_counter(), time.thread_time()
                matcher.fill_bitmask(bitmask, first_row + j)
                results.append((request_id, time.perf_counter() - started, time.thread_time() - cpu, None, 0.0))
                if j == len(draft_tokens) or matcher.accept([int(draft_tokens[j])]) != 1:
                    break
                accepted += 1
        finally:
            matcher.rollback(accepted)
        failures = self._after_fills(results, plain=False)
        if failures:
            raise GrammarError(self.backend_of(request_id) or "grammar", failures[request_id])
        return len(results)

    def accept(self, request_id: str, tokens: Sequence[int]) -> int:
        """Advance the request's matcher over `tokens`; returns how many were accepted (stops at the first invalid)."""
        request = self._requests.get(request_id)
        toks = [int(t) for t in tokens]
        n = self._matcher(request_id).accept(toks)
        if request is not None:
            request.tokens.extend(toks[:n])
        return n

    def consume(self, request_id: str, tokens: Sequence[int]) -> bool:
        """`accept` for tokens known to be allowed (sampled under the request's mask, or validated): no check
        first. Returns whether the matcher has terminated. GrammarError if one is rejected after all (the request
        must end: its matcher is unusable)."""
        toks = [int(t) for t in tokens]
        matcher = self._matcher(request_id)
        matcher.consume(toks)
        self._requests[request_id].tokens.extend(toks)
        return matcher.is_terminated()

    def rollback(self, request_id: str, n: int) -> None:
        """Undo the last `n` accepted tokens (rejected draft tokens)."""
        self._matcher(request_id).rollback(int(n))
        request = self._requests[request_id]
        if n > 0:
            del request.tokens[max(0, len(request.tokens) - int(n)) :]

    def validate_draft(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many leading draft `tokens` the grammar would accept; the matcher is unchanged."""
        return self._matcher(request_id).validate([int(t) for t in tokens])

    def first_allowed(self, request_id: str, candidates: Sequence[int]) -> int | None:
        """The position in `candidates` of the first token the grammar accepts next, or None; the matcher is
        unchanged. One validation per candidate tried (microseconds each, against a mask fill's 0.05-1 ms)."""
        matcher = self._matcher(request_id)
        for i, token in enumerate(candidates):
            if matcher.validate([int(token)]) == 1:
                return i
        return None

    def skip_traits(self, request_id: str) -> tuple[bool, bool]:
        """(validates as masks, mask was open), in one look-up: whether the request's backend validates exactly the
        tokens its masks allow (see `GrammarBackend`: only then may a row be sampled unmasked and its argmax
        validated afterwards), and whether its last plain mask allowed at least `OPEN_MASK_FRACTION` of the
        vocabulary and, if it was filled alone (timed), took at least `config.unmasked_min_fill_ms` of CPU (False
        before its first fill): a state of free text, where a model's own choice is most likely allowed and a fill
        is expensive."""
        request = self._request(request_id)
        grammar = request.grammar
        return grammar is not None and self.backend(grammar.backend).validates_as_masks, request.open_mask

    def forced_tokens(self, request_id: str, limit: int = 16) -> list[int]:
        """At most `limit` tokens the grammar forces next (empty if it allows a choice); the matcher is unchanged."""
        forced = self._matcher(request_id).forced_tokens(limit)
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
        for name in BACKENDS if self.config.backend == "auto" else (self.config.backend,):
            self.backend(name)

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

    # --- stats / shutdown -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and percentiles as plain numbers (times in milliseconds / microseconds as named)."""
        with self._lock:
            counts = dict(self._counts)
            per_backend = {b: list(d) for b, d in self._compile_s.items()}
            fill_s = list(self._fill_row_s)
            queued, running = len(self._inflight), self._running
        every = [s for d in per_backend.values() for s in d]
        out = {
            **{k: float(v) for k, v in counts.items()},
            "compile_ms_p50": 1e3 * percentile(every, 50),
            "compile_ms_p99": 1e3 * percentile(every, 99),
            "compile_queue": float(queued),
            "compiling": float(running),
            "cache_entries": float(len(self._cache)),
            "cache_bytes": float(self._cache.bytes_used),
            "cache_capacity_bytes": float(self._cache.capacity),
            "cache_evictions": float(self._cache.evictions),
            "mask_fill_us_per_row_p50": 1e6 * percentile(fill_s, 50),
            "mask_fill_us_per_row_p99": 1e6 * percentile(fill_s, 99),
            "requests": float(len(self._requests)),
        }
        for b, durations in per_backend.items():
            out[f"compile_ms_p50_{b}"] = 1e3 * percentile(durations, 50)
            out[f"compile_ms_p99_{b}"] = 1e3 * percentile(durations, 99)
        return out

    def compile_durations_s(self, backend: str | None = None) -> list[float]:
        """The recent compile durations (seconds) of one backend, or of both; oldest first per backend."""
        with self._lock:
            return [s for b, d in self._compile_s.items() if backend in (None, b) for s in d]

    def shutdown(self) -> None:
        """Stop both pools (queued compiles are cancelled; running ones are not waited for) and the workers."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            held, self._held = self._held or [], None
        for future, *_ in held:
            future.cancel()
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
        self._slack_pool.shutdown(wait=False, cancel_futures=True)
        for backend in list(self._backends.values()):
            backend.close()

    # --- internals ----------------------------------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown structured-output request {request_id!r}")
        return request

    def _matcher(self, request_id: str) -> Matcher:
        request = self._requests.get(request_id)
        if request is not None and request.matcher is not None and request.state == READY:
            return request.matcher  # (poll has nothing left to do: the hot path, several calls per row and step)
        state = self.poll(request_id)
        request = self._requests[request_id]
        if state != READY or request.matcher is None:
            raise RuntimeError(f"structured-output request {request_id!r} is {state}, not ready" + (f": {request.error}" if request.error else ""))
        return request.matcher

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _after_fills(self, results: list[_Filled], plain: bool = True) -> dict[str, str]:
        """Record fill times (overall and per grammar) and, for plain rows, whether each mask was open; move or fail
        requests whose fill failed, or used more than `max_fill_ms` of CPU time (CPU, not wall: a fill preempted on
        a busy machine is not slow)."""
        failures = {rid: err for rid, _, _, err, _ in results if err is not None}
        slow: dict[str, float] = {}
        for rid, _, cpu, err, allowed in results:
            request = self._requests.get(rid)
            if err is None and request is not None and request.grammar is not None:
                if plain:
                    request.open_mask = allowed >= OPEN_MASK_FRACTION
                if cpu == UNTIMED:
                    continue
                self._router.record_fill(request.grammar.backend, request.text_key, cpu)
                if cpu * 1e3 > self.config.max_fill_ms:
                    slow[rid] = max(slow.get(rid, 0.0), cpu)
        with self._lock:
            self._fill_row_s.extend(s for _, s, _, err, _ in results if err is None)  # a batched row: its share
            self._counts["rows_filled"] += len(results)
            self._counts["fill_errors"] += len(failures)
            self._counts["slow_fills"] += len(slow)
        for rid, seconds in slow.items():
            problem = self._move_to_llguidance(rid, seconds)
            if problem is not None:
                failures[rid] = problem
        return failures

    def _move_to_llguidance(self, request_id: str, seconds: float) -> str | None:
        """After a slow xgrammar fill: serve the request by llguidance from its current position; None when moved,
        else why the request must end (the fill has already happened: its row is valid, later ones would stall)."""
        request = self._requests[request_id]
        took = f"a mask took {1e3 * seconds:.0f} ms of CPU time, over the limit of {self.config.max_fill_ms:g} ms"
        assert request.grammar is not None
        if request.grammar.backend == "llguidance" or request.requested != "auto":
            return f"{request.grammar.backend}: {took}"
        try:
            grammar = self._cache.get(_key("llguidance", request.spec)) or self.backend("llguidance").compile(request.spec)
            matcher = self.backend("llguidance").matcher(grammar)
        except Exception as e:  # noqa: BLE001 - cannot move: the request ends, the others go on
            return f"xgrammar: {took}; llguidance cannot serve it: {e}"
        if matcher.accept(request.tokens) != len(request.tokens):
            return f"xgrammar: {took}; llguidance disagrees on the tokens accepted so far"
        self._cache.put(_key("llguidance", request.spec), grammar)
        request.grammar, request.matcher = grammar, matcher
        request.reason = f"llguidance: moved from xgrammar ({took})"
        self._count("switches")
        return None

    def _cached(self, route: Route, spec: GrammarSpec) -> CompiledGrammar | None:
        """A cached grammar from the first candidate backend not known to reject the spec (the one a compile
        would pick), or None."""
        for name in route.backends:
            key = _key(name, spec)
            grammar = self._cache.get(key)
            if grammar is not None:
                return grammar
            with self._lock:
                if key not in self._rejected:
                    return None
        return None

    def _known_rejection(self, route: Route, spec: GrammarSpec) -> str | None:
        """The combined message if every candidate backend is known to reject `spec`, else None."""
        with self._lock:
            found = [self._rejected.get(_key(name, spec)) for name in route.backends]
        rejections = [e for e in found if e is not None]
        if len(rejections) < len(found):
            return None
        return str(_combined(rejections))

    def _compile_job(self, backends: tuple[str, ...], spec: GrammarSpec, *, background: bool = False) -> _Job:
        """The in-flight job for (backends, spec), or a new one; GrammarQueueFull when the queue is full."""
        with self._lock:
            job = self._inflight.get((backends, spec))
            if job is not None:
                self._counts["coalesced"] += 1
                return job
            # the job may have finished (and left _inflight) since the caller looked at the cache
            for name in backends:
                hit = self._cache.get(_key(name, spec))
                if hit is not None:
                    self._counts["cache_hits"] += 1
                    done: Future[CompiledGrammar] = Future()
                    done.set_result(hit)
                    return _Job(done, _JobClock())
            limit = self.config.max_queued_compiles // 2 if background else self.config.max_queued_compiles
            if len(self._inflight) >= limit:
                self._counts["queue_full"] += 1
                raise GrammarQueueFull("structured outputs", f"{len(self._inflight)} grammars are already compiling; retry later")
            self._counts["cache_misses"] += 1
            clock = _JobClock()
            if self._held is None:
                job = _Job(self._compile_pool.submit(self._run_compile, backends, spec, clock), clock)
            else:  # (a pool's future: cancelled only before it runs, see `_run_held`)
                job = _Job(Future(), clock)
                self._held.append((job.future, backends, spec, clock))
            self._inflight[(backends, spec)] = job
        job.future.add_done_callback(lambda _f: self._forget_inflight(backends, spec))
        return job

    def _maybe_promote(self, request: _Request) -> None:
        """auto: a grammar asked for often enough also gets an xgrammar compile, in the background."""
        if request.requested != "auto" or not self._router.should_promote(request.text_key):
            return
        key = _key("xgrammar", request.spec)
        with self._lock:
            if key in self._rejected or (("xgrammar",), request.spec) in self._inflight:
                return
        if self._cache.get(key) is not None:
            return
        try:
            self._compile_job(("xgrammar",), request.spec, background=True)
        except GrammarQueueFull:
            return  # busy: promote later
        self._count("promotions")

    def _abandon(self, request: _Request) -> None:
        """Detach a timed-out request from its compile; cancel the job if it has not started and nobody else waits."""
        job, request.job = request.job, None
        if job is None:
            return
        waiting = any(r.job is job for r in self._requests.values())
        if not waiting and job.future.cancel():
            self._forget_inflight(request.route.backends, request.spec)

    def _forget_inflight(self, backends: tuple[str, ...], spec: GrammarSpec) -> None:
        with self._lock:
            self._inflight.pop((backends, spec), None)

    def _run_held(self, future: Future[CompiledGrammar], backends: tuple[str, ...], spec: GrammarSpec,
                  clock: _JobClock) -> None:
        """(A compile thread.) A held job: `_run_compile` into its future, as the pool runs its own (nothing when it
        was cancelled before it ran)."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._run_compile(backends, spec, clock))
        except BaseException as e:  # noqa: BLE001 - the job's outcome, read by `poll`
            future.set_exception(e)

    def _run_compile(self, backends: tuple[str, ...], spec: GrammarSpec, clock: _JobClock) -> CompiledGrammar:
        """Runs on a compile thread: try the backends in order; cache the first success, remember each rejection.
        Raises GrammarError with every candidate's reason when all reject."""
        clock.begin()
        with self._lock:
            self._running += 1
        try:
            rejections: list[GrammarError] = []
            for name in backends:
                grammar = self._compile_on(name, spec, rejections, clock)
                if grammar is not None:
                    return grammar
            raise _combined(rejections)
        finally:
            with self._lock:
                self._running -= 1

    def _compile_on(
        self, name: str, spec: GrammarSpec, rejections: list[GrammarError], clock: _JobClock
    ) -> CompiledGrammar | None:
        key = _key(name, spec)
        grammar = self._cache.get(key)
        if grammar is not None:
            return grammar
        with self._lock:
            known = self._rejected.get(key)
        if known is not None:
            rejections.append(known)
            return None
        backend = clock.exclude(lambda: self.backend(name))
        started = time.perf_counter()
        try:
            grammar = backend.compile(spec)
        except GrammarError as e:
            self._remember_rejection(key, e)
            rejections.append(e)
            return None
        finally:
            with self._lock:
                self._counts["compiles"] += 1
                self._compile_s[name].append(time.perf_counter() - started)
        self._cache.put(key, grammar)
        return grammar

    def _remember_rejection(self, key: CacheKey, error: GrammarError) -> None:
        with self._lock:
            self._counts["compile_errors"] += 1
            self._rejected[key] = error
            self._rejected.move_to_end(key)
            while len(self._rejected) > self.config.rejected_entries:
                self._rejected.popitem(last=False)



def _key(backend: str, spec: GrammarSpec) -> CacheKey:
    return (backend, spec.kind, spec.text, spec.whitespace)


def _combined(rejections: Sequence[GrammarError]) -> GrammarError:
    """One backend's rejection as is; several as 'xgrammar: ...; llguidance: ...'."""
    if len(rejections) == 1:  # a fresh exception: the stored one must not collect tracebacks
        return GrammarError(rejections[0].backend, rejections[0].reason)
    return GrammarError("auto", "; ".join(str(e) for e in rejections))


@dataclass(frozen=True)
class Slack:
    """Rows of a fill that may be left untouched (their tokens checked after sampling), filled while each is
    expected to finish by `deadline` (a `time.perf_counter()` instant: a share of the forward's expected time) and
    `ends_with` (the forward, where a thread completes it when the device is done) has not completed."""

    request_ids: Sequence[str]
    rows: Sequence[int]
    deadline: float
    ends_with: Future[Any] | None = None


class PendingFill:
    """A fill under way (`StructuredOutputManager.start_fill`): its batches run on fill-pool threads, its slack
    rows on the slack pool's."""

    def __init__(self, manager: StructuredOutputManager, bitmask: np.ndarray) -> None:
        self.done: list[_Filled] = []  # rows settled when the fill started: skipped, filled alone
        self.batches: list[tuple[str, list[_Work], Future[float]]] = []  # (backend, rows, seconds of the call)
        self.slack: SlackFill[tuple[str, _Work], _Filled] | None = None
        self.num_slack_filled = 0  # skippable rows filled in the slack (known after `result()`)
        self._manager = manager
        self._bitmask = bitmask
        self._outcome: tuple[dict[str, str], list[str]] | None = None

    def stop_slack(self) -> None:
        """No further slack row starts; `result()` still waits for those filling."""
        if self.slack is not None:
            self.slack.stop()

    def result(self) -> tuple[dict[str, str], list[str]]:
        """Wait for the slack rows (until their deadline) and the batches; (failures, the requests whose rows were
        left as they were: probe passed, or slack rows not reached)."""
        if self._outcome is not None:
            return self._outcome
        results = self.done
        if self.slack is not None:
            filled = self.slack.join()
            ids = {r[0] for r in filled}
            results = [r for r in results if r[4] != SKIPPED or r[0] not in ids] + filled
            self.num_slack_filled = len(ids)
            self._manager._count("slack_fills", len(ids))
        for _, work, future in self.batches:
            try:
                seconds: float | None = future.result()
            except Exception:  # noqa: BLE001 - the rows are filled one by one instead, each failing alone
                logger.exception("a batched fill of %d rows failed; filling them one by one", len(work))
                seconds = None
            results.extend(self._manager._settle_batch(work, self._bitmask, seconds))
        skipped = [r[0] for r in results if r[4] == SKIPPED]  # (a row whose probe failed is an error row, filled)
        self._outcome = self._manager._after_fills([r for r in results if r[4] != SKIPPED]), skipped
        return self._outcome


class _RowQueue:
    """Rows to fill, handed out a few at a time to whichever thread asks next: a row costs 0.01-1 ms by the
    grammar's state, so fixed halves left one thread idle while the other filled the expensive rows (256 rows in
    `tandem bench simulated`: the fill's wall time was 1.48x the rows' summed time / 2 threads with halves, 1.32x
    with this queue)."""

    def __init__(self, work: list[_Work], bitmask: np.ndarray, eos: Sequence[int], measure_over_s: float) -> None:
        self._work = work
        # rows per hand-out: up to 4 in a large fill (few lock round trips), 1 in a small one (every thread gets some)
        self._batch = max(1, min(4, len(work) // 16))
        self._fill = (bitmask, eos, measure_over_s)
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> list[_Work]:
        with self._lock:
            start = self._next
            self._next = min(len(self._work), start + self._batch)
        return self._work[start : self._next] if start < len(self._work) else []

    def drain(self) -> list[_Filled]:
        """Fill rows until none is left; their results."""
        out: list[_Filled] = []
        while batch := self.take():
            out.extend(_fill_chunk(batch, *self._fill))
        return out


def _fill_chunk(chunk: Sequence[_Work], bitmask: np.ndarray, eos: Sequence[int], measure_over_s: float) -> list[_Filled]:
    """Fill one chunk's rows: (request id, seconds, CPU seconds, error or None, allowed fraction) per row. A failed
    row allows only EOS; a row whose probe tokens are all allowed is left as it was (allowed fraction SKIPPED). The
    allowed fraction is measured only for a fill over `measure_over_s` of CPU (only such a fill is worth skipping
    next time), else 0."""
    out: list[_Filled] = []
    for rid, matcher, row, probe in chunk:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            if probe and _probe_passes(matcher, probe):
                out.append((rid, 0.0, 0.0, None, SKIPPED))
                continue
            matcher.fill_bitmask(bitmask, row)
            error = None
        except Exception as e:  # noqa: BLE001 - one request's grammar failing must not fail the step
            fill_only(bitmask, row, eos)
            error = f"mask computation failed: {type(e).__name__}: {e}"
        cpu = time.thread_time() - cpu
        # only a costly fill is worth skipping next time; a cheap one (a structural state) is not even measured
        allowed = float(_allowed_fractions(bitmask, [row])[0]) if cpu >= measure_over_s and error is None else 0.0
        out.append((rid, time.perf_counter() - started, cpu, error, allowed))
    return out


def _probe_passes(matcher: Matcher, probe: Sequence[int]) -> bool:
    """Each probe token is allowed next (a state of free text: the fill may be skipped)."""
    return all(matcher.validate([token]) == 1 for token in probe)


def _allowed_fractions(bitmask: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """float64 [len(rows)]: the fraction of set bits in each of `rows`, estimated from one cache line in every
    `_DENSITY_LINES` (a batched fill measures every row: it has no CPU time per row to tell a costly one)."""
    index = np.asarray(rows, dtype=np.intp)
    lines = bitmask.shape[1] // _LINE_WORDS
    if lines < 2 * _DENSITY_LINES:  # a small vocabulary: count every word
        sample = bitmask[index]  # [n, W]
    else:  # [n, lines / _DENSITY_LINES, 16]: a view split into lines, then one line in every _DENSITY_LINES copied
        sample = bitmask[:, : lines * _LINE_WORDS].reshape(bitmask.shape[0], lines, _LINE_WORDS)[:, ::_DENSITY_LINES][index]
    sample = sample.reshape(len(index), -1).view(np.uint32)  # bitwise_count of a signed int counts its absolute value
    return np.bitwise_count(sample).sum(axis=1) / (32 * max(1, sample.shape[1]))


def _xgrammar(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int], config: StructuredOutputConfig) -> GrammarBackend:
    from tandem.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(hf_tokenizer, vocab_size, eos, compile_threads=config.num_threads,
                           isolated=config.isolate_compiles, compile_cpu_limit_s=config.compile_timeout_s)


def _llguidance(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int], config: StructuredOutputConfig) -> GrammarBackend:
    from tandem.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(hf_tokenizer, vocab_size, eos, fill_threads=config.num_threads)


def _timed_call(call: Callable[[], None], begun: threading.Event | None = None) -> float:
    """`call()` (after setting `begun`); its wall seconds."""
    started = time.perf_counter()
    if begun is not None:
        begun.set()
    call()
    return time.perf_counter() - started
