"""Draft-model speculation: a small model with the target's vocabulary drafts K greedy tokens per request.

The draft runs on the host CPU in its own worker process (multiprocessing *spawn*, pinned to its own cores, its own
torch thread count), so its forwards overlap the accelerator's verification forward without competing for the
engine's GIL. It can also run in-process (`in_process=True`, or a draft on the target's accelerator).

The draft keeps its own paged KV cache (a `ModelRunner` + `BlockManager` of its own). Per request it remembers the
tokens it holds KV for; the parent keeps an exact mirror of that list, so each step only the *difference* crosses
the process boundary, as plain lists of ints:

    job = (request_id, keep, new_tokens, k)

meaning "roll your KV back to the first `keep` tokens, feed `new_tokens`, then draft `k` tokens". With the target's
tokens `t` (prompt + accepted output) and the worker's tokens `w` (its last context + the drafts it fed),
`keep = min(lcp(t, w), len(t) - 1)` (the last token is always re-fed: its logits give the first draft) and
`new_tokens = t[keep:]`. Step 1 of a proposal feeds every request's `new_tokens` in one batched forward and takes
the argmax of each request's last row as draft 1; steps 2..k feed draft i-1 of every still-drafting request in one
batched forward each. Draft k is never fed, so afterwards the worker holds KV for `t + drafts[:-1]`.

Greedy drafts carry `probs=None` (a deterministic proposal q = one-hot): the rejection rule stays lossless, accepting
draft x with probability p(x) and otherwise resampling from the residual of p without x.

Failure policy: a worker that dies or does not answer within `timeout_s` is killed; that call and every later one
return empty drafts (speculation off, one warning logged), never an exception into the engine, and every request of
the batch still gets an entry. An exception inside the worker resets all its requests (they are re-prefilled on
their next proposal) and only that call returns no drafts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.config import CacheConfig, ConfigError, SchedulerConfig
from tandem.core.kv_blocks import BlockManager
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.models.loader import load_checkpoint
from tandem.params import SamplingParams
from tandem.request import Request
from tandem.runner.runner import ModelRunner
from tandem.runner.tensor_thread import on_tensor_thread
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer
from tandem.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_KV_CACHE_MEMORY = (
    256 * 2**20
)  # bytes of draft KV cache when neither a budget nor a block count is given

# One request's sync-and-draft job: (request id, KV tokens to keep, tokens to feed, drafts wanted).
SyncJob = tuple[str, int, list[int], int]
# A proposal's answer: drafts per request id, and the ids whose state the draft dropped (re-prefilled next time).
ProposeReply = tuple[dict[str, list[int]], list[str]]


class DraftWorkerError(RuntimeError):
    """The draft worker could not start, died, or did not answer in time."""


class DraftStepError(RuntimeError):
    """One proposal failed inside the draft (its state was reset); the next proposal starts from scratch."""


# -------------------------------------------------------------------------------------------------------------
# Plain-data settings and facts (pickled to the worker and back)
# -------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftModelOptions:
    """What a draft core needs to build itself; plain data, so it crosses the spawn boundary."""

    model_path: str
    target_vocab_size: int
    dtype: str = "bfloat16"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's setting
    cpu_cores: tuple[int, ...] | None = None  # worker only: os.sched_setaffinity set
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the draft's max_position_embeddings
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    vocab_rows: int | None = None  # drafts only among ids < vocab_rows: the output projection keeps those rows


@dataclass(frozen=True)
class DraftModelInfo:
    """What the draft tells its owner once loaded."""

    vocab_size: int
    tokenizer_path: str
    max_model_len: int
    num_blocks: int
    block_size: int
    num_layers: int
    pid: int


# -------------------------------------------------------------------------------------------------------------
# The draft core: model, own KV cache, per-request sync and batched greedy drafting (runs in whichever process)
# -------------------------------------------------------------------------------------------------------------


class DraftModelCore:
    """A draft model with its own paged KV cache; `propose` syncs requests and drafts for all of them in batches.

    Invariant per request `seq` in `_seqs`: positions `[0, seq.num_tokens)` of `seq.token_ids` have valid KV in
    `seq.block_ids`, and `seq.num_computed_tokens == seq.num_tokens`.
    """

    def __init__(self, options: DraftModelOptions) -> None:
        if options.dtype not in _DTYPES:
            raise ConfigError(f"draft_dtype must be one of {sorted(_DTYPES)}, got {options.dtype!r}")
        dtype = _DTYPES[options.dtype]
        ckpt = load_checkpoint(options.model_path, dtype, progress=False)
        cfg = dataclasses.replace(ckpt.config, output_rows=options.vocab_rows)
        max_len = min(options.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        sched = SchedulerConfig(
            max_num_seqs=options.max_num_seqs, max_num_batched_tokens=max_len, max_model_len=max_len
        )
        budget = options.kv_cache_memory
        if budget is None and options.num_blocks is None:
            budget = DEFAULT_KV_CACHE_MEMORY
        cache = CacheConfig(
            block_size=options.block_size,
            kv_cache_memory=budget,
            enable_prefix_caching=False,
            num_blocks=options.num_blocks,
        )
        self.runner = ModelRunner(
            cfg, ckpt.weights, dtype, options.device, cache, sched, num_threads=options.num_threads
        )
        self.blocks = BlockManager(self.runner.num_blocks, options.block_size, enable_prefix_caching=False)
        # drafts are ids < vocab_limit
        self.vocab_limit = min(cfg.vocab_size, options.target_vocab_size, cfg.output_rows or cfg.vocab_size)
        self.info = DraftModelInfo(
            vocab_size=cfg.vocab_size,
            tokenizer_path=str(ckpt.tokenizer_path),
            max_model_len=max_len,
            num_blocks=self.runner.num_blocks,
            block_size=options.block_size,
            num_layers=cfg.num_layers,
            pid=os.getpid(),
        )
        self._seqs: OrderedDict[str, Request] = OrderedDict()  # least recently drafted first
        self._params = SamplingParams()  # Request wants params; the draft always decodes greedily
        self._step_id = 0

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def tokens_of(self, request_id: str) -> list[int]:
        """The tokens the draft holds KV for (a copy; [] for an unknown request)."""
        seq = self._seqs.get(request_id)
        return list(seq.token_ids) if seq is not None else []

    def release(self, request_id: str) -> None:
        """Free the request's KV blocks and forget it (no-op for an unknown id)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    def reset(self) -> None:
        """Forget every request (after a failed step: their KV may be half-written)."""
        for rid in list(self._seqs):
            self.release(rid)

    def propose(self, releases: Sequence[str], jobs: Sequence[SyncJob]) -> ProposeReply:
        """Release `releases`, then sync every job's request and draft its `k` tokens.

        Changes each job's KV to `tokens[:keep] + new_tokens + drafts[:-1]`. A request whose blocks cannot be found
        even after evicting idle requests gets no drafts and is dropped; evicted and dropped ids are reported.
        """
        for rid in releases:
            self.release(rid)
        drafts: dict[str, list[int]] = {job[0]: [] for job in jobs}
        dropped: list[str] = []
        busy = {job[0] for job in jobs}
        running: list[tuple[Request, list[int], int]] = []  # (seq, tokens to feed next, k)
        for rid, keep, new_tokens, k in jobs:
            seq = self._rolled_back(rid, keep)
            need = seq.num_tokens + len(new_tokens) + k - 1  # KV positions this proposal writes up to
            if not self._make_room(seq, need, busy, dropped):
                self.release(rid)
                dropped.append(rid)
                continue
            running.append((seq, list(new_tokens), k))
        while running:
            next_tokens = self._forward_greedy([(seq, feed) for seq, feed, _ in running])
            for (seq, _, _), tok in zip(running, next_tokens, strict=True):
                drafts[seq.request_id].append(tok)
            running = [
                (seq, [tok], k)
                for (seq, _, k), tok in zip(running, next_tokens, strict=True)
                if len(drafts[seq.request_id]) < k
            ]
        return drafts, dropped

    # ------------------------------------------------------------------------------------------------- inner
    def _rolled_back(self, request_id: str, keep: int) -> Request:
        """The request's state with its KV cut back to the first `keep` tokens (created empty when new)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            if keep:
                raise DraftStepError(
                    f"request {request_id!r} is unknown to the draft but {keep} tokens were kept"
                )
            seq = Request(request_id, [], self._params)
            self._seqs[request_id] = seq
        if keep > seq.num_tokens:
            raise DraftStepError(f"request {request_id!r}: asked to keep {keep} of {seq.num_tokens} tokens")
        del seq.token_ids[keep:]
        seq.num_computed_tokens = keep
        self.blocks.truncate(seq, keep)
        self._seqs.move_to_end(request_id)
        return seq

    def _make_room(self, seq: Request, num_tokens: int, busy: set[str], evicted: list[str]) -> bool:
        """Blocks for positions [0, num_tokens) of `seq`, evicting least recently drafted idle requests if needed."""
        if num_tokens > self.info.max_model_len:
            return False
        while not self.blocks.ensure_slots(seq, num_tokens):
            victim = next((rid for rid in self._seqs if rid not in busy), None)
            if victim is None:
                return False
            self.release(victim)
            evicted.append(victim)
        return True

    def _forward_greedy(self, feeds: Sequence[tuple[Request, list[int]]]) -> list[int]:
        """One batched forward feeding each request its tokens; returns each request's argmax next token."""
        self._step_id += 1
        plan = StepPlan(
            self._step_id,
            [
                ScheduledRequest(seq.request_id, tokens, seq.num_tokens, seq.block_ids)
                for seq, tokens in feeds
            ],
        )
        logits = self.runner.execute(plan)  # [num_requests, V] float32, one row per request (its last input)
        # on the tensor thread: a torch op on this one would start a second OpenMP team, whose threads then spin
        # beside the forward's (measured: decode steps of 4 requests 2.3x slower)
        next_tokens: list[int] = self.runner.on_tensor_thread(_argmax_ids, logits, self.vocab_limit)
        for seq, tokens in feeds:
            seq.append_tokens(tokens)
            seq.num_computed_tokens = seq.num_tokens
        return next_tokens

    def close(self) -> None:
        self.reset()
        self.runner.shutdown()


# -------------------------------------------------------------------------------------------------------------
# Where the core runs: in this process, or in a spawned worker process behind a pipe
# -------------------------------------------------------------------------------------------------------------


class DraftBackend(Protocol):
    """Runs proposals on a draft core somewhere; `call` raises DraftWorkerError / DraftStepError on failure."""

    info: DraftModelInfo

    def call(self, releases: list[str], jobs: list[SyncJob]) -> ProposeReply: ...

    def close(self) -> None: ...


class InProcessBackend:
    """The core in this process (no hang protection: a thread cannot be killed)."""

    def __init__(self, options: DraftModelOptions) -> None:
        threads = on_tensor_thread(torch.get_num_threads)
        try:
            self.core = on_tensor_thread(DraftModelCore, options)
        finally:  # the draft's runner set the tensor thread's count (shared with the target's forward): restore it
            on_tensor_thread(torch.set_num_threads, threads)
        self.info = self.core.info

    def call(self, releases: list[str], jobs: list[SyncJob]) -> ProposeReply:
        try:
            return self.core.propose(releases, jobs)
        except Exception as e:
            self.core.reset()
            raise DraftStepError(f"draft step failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.core.close()


def _worker_main(conn: mpc.Connection, options: DraftModelOptions) -> None:
    """The worker process: pin, load, say ready, then answer ("propose", releases, jobs) until ("close",) or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it closes us
    try:
        if options.cpu_cores:
            os.sched_setaffinity(0, options.cpu_cores)
        core = on_tensor_thread(DraftModelCore, options)  # all tensor work on one thread (see runner/tensor_thread.py)
    except BaseException as e:  # everything must reach the parent as a message
        kind = "config" if isinstance(e, ConfigError) else "fatal"
        conn.send(("error", kind, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", asdict(core.info)))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg[0] == "close":
            core.close()
            return
        try:
            drafts, dropped = on_tensor_thread(core.propose, msg[1], msg[2])
            reply: tuple[Any, ...] = ("drafts", drafts, dropped)
        except Exception as e:
            core.reset()
            reply = ("error", "step", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
        conn.send(reply)


class WorkerProcessBackend:
    """The core in a spawned process; every answer is awaited at most `timeout_s` seconds."""

    def __init__(self, options: DraftModelOptions, *, timeout_s: float, startup_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, options), name="tandem-draft", daemon=True
        )
        self.process.start()
        child_conn.close()  # only the child holds its end now: the child dying closes the pipe (EOF here)
        self.conn = parent_conn
        try:
            msg = self._receive(startup_timeout_s, "start")
        except DraftWorkerError as e:
            self.close()
            raise DraftWorkerError(
                f"{e}; see the worker's stderr. (A script that builds a worker must guard its top level with "
                "`if __name__ == '__main__':`, since multiprocessing spawn re-imports it.)"
            ) from e
        if msg[0] == "error":
            self.close()
            if msg[1] == "config":
                raise ConfigError(f"draft model {options.model_path}: {msg[2]}")
            raise DraftWorkerError(f"the draft worker failed to start ({options.model_path}): {msg[2]}")
        self.info = DraftModelInfo(**msg[1])

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def call(self, releases: list[str], jobs: list[SyncJob]) -> ProposeReply:
        try:
            self.conn.send(("propose", releases, jobs))
        except (OSError, ValueError) as e:  # broken pipe: the worker is gone
            self._kill()
            raise DraftWorkerError(f"the draft worker is gone ({self._exit_text()}): {e}") from e
        msg = self._receive(self.timeout_s, "answer a proposal")
        if msg[0] == "error":
            raise DraftStepError(f"draft step failed in the worker: {msg[2]}")
        return msg[1], msg[2]

    def _receive(self, timeout_s: float, doing: str) -> tuple[Any, ...]:
        """The worker's next message; kills it and raises DraftWorkerError on EOF, death or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise DraftWorkerError(
                    f"the draft worker did not {doing} within {timeout_s:.1f} s (hung?); killed it"
                )
            try:
                if self.conn.poll(min(left, 0.5)):
                    msg: tuple[Any, ...] = self.conn.recv()
                    return msg
            except (EOFError, OSError) as e:
                self._kill()
                raise DraftWorkerError(
                    f"the draft worker died before it could {doing} ({self._exit_text()})"
                ) from e
            if not self.process.is_alive():
                self._kill()
                raise DraftWorkerError(f"the draft worker died before it could {doing} ({self._exit_text()})")

    def _exit_text(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()

    def close(self) -> None:
        """Ask the worker to stop, wait a little, then kill it."""
        if self.process.is_alive() and not self.conn.closed:
            with contextlib.suppress(OSError, ValueError):  # the worker may be gone already
                self.conn.send(("close",))
            self.process.join(timeout=5.0)
        self._kill()


# -------------------------------------------------------------------------------------------------------------
# The proposer (engine side)
# -------------------------------------------------------------------------------------------------------------


@dataclass
class DraftStats:
    """Counters over the proposer's life (updated by `propose` and `on_verified`)."""

    num_proposals: int = 0  # requests drafted for
    num_drafted: int = 0  # draft tokens verified by the target
    num_accepted: int = 0  # of those, accepted
    num_failed_calls: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass
class _Mirror:
    """The parent's exact copy of what the draft holds KV for, for one request.

    `tokens[:confirmed]` were the target's tokens when last sent (they never change); the rest are fed drafts.
    """

    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0


class DraftModelProposer(Proposer):
    """Drafts with a small model of the target's vocabulary; see the module docstring for the protocol."""

    name = "draft_model"
    drafts_concurrently = True

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        num_speculative_tokens: int,
        target_vocab_size: int,
        target_tokenizer: Tokenizer | str | os.PathLike[str] | None,
        draft_device: str = "cpu",
        draft_dtype: str = "bfloat16",
        draft_threads: int | None = None,
        cpu_cores: Sequence[int] | None = None,
        in_process: bool = False,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        num_kv_blocks: int | None = None,
        draft_vocab_size: int | None = None,
        timeout_s: float = 30.0,
        startup_timeout_s: float = 300.0,
    ) -> None:
        """Load the draft (in a pinned worker process unless in-process) and check its vocabulary against the target's.

        `draft_vocab_size`: draft only among the first ids of the vocabulary (see `DraftModelOptions.vocab_rows`).
        Raises ConfigError for bad options or a vocabulary / tokenizer mismatch, DraftWorkerError when the worker
        does not come up within `startup_timeout_s`. In a worker, torch uses `draft_threads` threads (default: the
        number of `cpu_cores`, else 1); in-process, the process-wide thread count is left as the target set it.
        """
        if num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if timeout_s <= 0 or startup_timeout_s <= 0:
            raise ConfigError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, startup_timeout_s={startup_timeout_s}"
            )
        device = _draft_device(draft_device)
        self.in_process = in_process or device.type != "cpu"
        options = draft_options(
            model_path, target_vocab_size, draft_dtype, device, draft_threads, cpu_cores, self.in_process,
            DraftModelOptions(model_path="", target_vocab_size=0, block_size=block_size, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, num_blocks=num_kv_blocks,
                              vocab_rows=draft_vocab_size),
        )
        self.num_speculative_tokens = num_speculative_tokens
        self.backend = _start_backend(options, self.in_process, timeout_s, startup_timeout_s)
        try:
            check_vocabulary(self.backend.info, target_vocab_size, target_tokenizer)
        except BaseException:
            self.backend.close()
            raise
        self.info = self.backend.info
        self.stats = DraftStats()
        self.enabled = True  # False once the worker died or hung: speculation off
        self._mirrors: dict[str, _Mirror] = {}
        self._pending_releases: list[str] = []
        # guards _mirrors and _pending_releases (the engine's thread vs the drafting thread)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-draft")
        self._inflight: Future[dict[str, Drafts]] | None = None
        self._closed = False

    # ---------------------------------------------------------------------------------------------- protocol
    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        """Draft for every request of `batch` and wait for the answer (bounded by the worker timeout)."""
        return self.propose_async(batch).result()

    def propose_async(self, batch: Sequence[DraftRequest]) -> Future[dict[str, Drafts]]:
        """Queue drafting for `batch` and return at once (never waits for an earlier proposal: proposals run in
        call order on the drafting thread); the future holds one `Drafts` per request id.

        The token lists are copied here, so the engine may change them once this returns. The future never raises
        for a draft failure: it then holds empty drafts.
        """
        results = {r.request_id: Drafts([]) for r in batch}
        if not self.enabled or self._closed:
            return _done(results)
        snapshot = [DraftRequest(r.request_id, [*r.token_ids, *r.assumed], r.num_prompt_tokens, r.max_drafts)
                    for r in batch]  # (the draft's KV follows any context: it rolls back to the common prefix)
        self._inflight = self._executor.submit(self._sync_and_run, snapshot, results)
        return self._inflight

    def _sync_and_run(self, batch: list[DraftRequest], results: dict[str, Drafts]) -> dict[str, Drafts]:
        """Drafting thread: bring the mirrors up to `batch` and run one call to the draft."""
        if not self.enabled:
            return results
        jobs = self._sync_jobs(batch)
        with self._lock:
            releases, self._pending_releases = self._pending_releases, []
        if not jobs and not releases:
            return results
        return self._run(releases, jobs, results)

    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        """Count acceptance; the KV rollback itself happens at the next proposal (it compares token lists)."""
        self.stats.num_drafted += num_drafted
        self.stats.num_accepted += len(accepted)

    def release(self, request_id: str) -> None:
        """Forget the request; its draft KV blocks are freed with the next message to the draft."""
        with self._lock:
            if self._mirrors.pop(request_id, None) is not None:
                self._pending_releases.append(request_id)

    def close(self) -> None:
        """Stop the worker (or free the in-process draft); later proposals return empty drafts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wait_inflight()
        self._executor.shutdown(wait=True)
        self.backend.close()

    def __enter__(self) -> DraftModelProposer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- inner
    def _sync_jobs(self, batch: Sequence[DraftRequest]) -> list[SyncJob]:
        """One job per request with K > 0; updates the mirrors to what the draft will hold after feeding."""
        jobs: list[SyncJob] = []
        max_len = self.info.max_model_len
        with self._lock:
            for r in batch:
                n = len(r.token_ids)
                k = min(r.max_drafts, self.num_speculative_tokens, max_len - n)
                if k <= 0 or n == 0:
                    continue
                mirror = self._mirrors.setdefault(r.request_id, _Mirror())
                keep = min(_common_prefix(mirror, r.token_ids), n - 1)
                new_tokens = [int(t) for t in r.token_ids[keep:n]]
                del mirror.tokens[keep:]
                mirror.tokens.extend(new_tokens)
                mirror.confirmed = n
                jobs.append((r.request_id, keep, new_tokens, k))
        return jobs

    def _run(self, releases: list[str], jobs: list[SyncJob], results: dict[str, Drafts]) -> dict[str, Drafts]:
        """Drafting thread: one call to the draft; fills `results` and extends the mirrors by the fed drafts."""
        try:
            drafts, dropped = self.backend.call(releases, jobs)
        except DraftWorkerError as e:
            self._turn_off(str(e))
            return results
        except DraftStepError as e:
            logger.warning("%s; no drafts this step, the draft's requests will be re-prefilled", e)
            self.stats.num_failed_calls += 1
            with self._lock:
                self._mirrors.clear()
            return results
        with self._lock:
            for rid, tokens in drafts.items():
                mirror = self._mirrors.get(rid)
                if mirror is not None:  # None: released meanwhile (its release is already queued)
                    mirror.tokens.extend(tokens[:-1])  # draft k is not fed
                results[rid] = Drafts(tokens)
            for rid in dropped:
                self._mirrors.pop(rid, None)
        self.stats.num_proposals += len(jobs)
        return results

    def _turn_off(self, reason: str) -> None:
        if self.enabled:
            logger.warning("draft-model speculation turned off: %s", reason)
        self.enabled = False
        self.stats.num_failed_calls += 1
        with self._lock:
            self._mirrors.clear()
            self._pending_releases.clear()

    def _wait_inflight(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            fut.result()  # never raises: _run turns every draft failure into empty drafts


def _argmax_ids(logits: torch.Tensor, limit: int) -> list[int]:
    """Each row's argmax among the first `limit` ids (logits [R, V])."""
    return logits[:, :limit].argmax(dim=-1).tolist()


def check_vocabulary(
    info: DraftModelInfo, target_vocab_size: int, target_tokenizer: Tokenizer | str | os.PathLike[str] | None
) -> None:
    """ConfigError unless the draft speaks the target's vocabulary.

    The tokenizers must map every id to the same token string. The models' vocabulary sizes must be equal, or both
    at least the tokenizer's size (they differ only in padding rows, which drafts never use).
    """
    if target_tokenizer is not None:
        target = (
            target_tokenizer
            if isinstance(target_tokenizer, Tokenizer)
            else Tokenizer.from_path(Path(target_tokenizer))
        )
        draft = Tokenizer.from_path(info.tokenizer_path)
        t_strings, d_strings = target.token_strings(), draft.token_strings()
        if t_strings != d_strings:
            first = next(
                (i for i, (a, b) in enumerate(zip(t_strings, d_strings, strict=False)) if a != b),
                min(len(t_strings), len(d_strings)),
            )
            shown = (
                f"id {first} is {t_strings[first]!r} for the target but {d_strings[first]!r} for the draft"
                if first < min(len(t_strings), len(d_strings))
                else f"the target's tokenizer has {len(t_strings)} tokens, the draft's {len(d_strings)}"
            )
            raise ConfigError(
                f"the draft model's tokenizer differs from the target's: {shown}; draft and target must share a vocabulary"
            )
        tokenizer_size = len(t_strings)
    else:
        tokenizer_size = min(info.vocab_size, target_vocab_size)
    if info.vocab_size != target_vocab_size and min(info.vocab_size, target_vocab_size) < tokenizer_size:
        raise ConfigError(
            f"the draft model's vocab_size {info.vocab_size} differs from the target's {target_vocab_size} "
            f"(tokenizer: {tokenizer_size} tokens); draft and target must share a vocabulary"
        )


def make_draft_model_proposer(**options: Any) -> DraftModelProposer:
    """Registry factory: `make_proposer("draft_model", model=..., num_speculative_tokens=..., ...)`.

    Accepts vLLM's `model` as an alias of `model_path`.
    """
    if "model" in options:
        if "model_path" in options:
            raise ConfigError("give the draft model as either model= or model_path=, not both")
        options["model_path"] = options.pop("model")
    if "model_path" not in options:
        raise ConfigError("the draft_model proposer needs model_path= (the draft checkpoint)")
    return DraftModelProposer(**options)


# -------------------------------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------------------------------


def _common_prefix(mirror: _Mirror, token_ids: Sequence[int]) -> int:
    """Length of the longest common prefix of the mirror and `token_ids`.

    The first `confirmed` tokens were the target's tokens last time and token lists only grow, so only the tail is
    compared (at most K fed drafts); if the last confirmed token changed anyway, everything is compared.
    """
    known = mirror.tokens
    n = len(token_ids)
    start = mirror.confirmed
    if start > n or (start and int(token_ids[start - 1]) != known[start - 1]):
        start = 0
    limit = min(len(known), n)
    i = start
    while i < limit and known[i] == int(token_ids[i]):
        i += 1
    return i


def draft_options(
    model_path: str | os.PathLike[str],
    target_vocab_size: int,
    dtype: str,
    device: torch.device,
    threads: int | None,
    cpu_cores: Sequence[int] | None,
    in_process: bool,
    cache: DraftModelOptions,
) -> DraftModelOptions:
    """Checked options of a draft core; `cache` supplies the block / sequence / memory settings."""
    if dtype not in _DTYPES:
        raise ConfigError(f"draft_dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    rows = cache.vocab_rows
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ConfigError(f"draft_vocab_size must be a positive integer or None, got {rows!r}")
    cores = _check_cores(cpu_cores)
    if threads is None and not in_process:
        threads = len(cores) if cores else 1
    return dataclasses.replace(
        cache,
        model_path=str(Path(model_path).expanduser()),
        target_vocab_size=target_vocab_size,
        dtype=dtype,
        device=str(device),
        num_threads=threads,
        cpu_cores=None if in_process else cores,
    )


def _start_backend(options: DraftModelOptions, in_process: bool, timeout_s: float, startup_timeout_s: float) -> DraftBackend:
    if in_process:
        return InProcessBackend(options)
    return WorkerProcessBackend(options, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s)


def _draft_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"draft_device {device!r} is not a torch device (e.g. 'cpu', 'cuda'): {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "draft_device 'cuda' was asked for but torch sees no CUDA device; use draft_device='cpu'"
        )
    return dev


def _check_cores(cpu_cores: Sequence[int] | None) -> tuple[int, ...] | None:
    if cpu_cores is None:
        return None
    cores = tuple(int(c) for c in cpu_cores)
    total = os.cpu_count() or 1
    bad = [c for c in cores if not 0 <= c < total]
    if not cores or bad:
        raise ConfigError(
            f"cpu_cores must be a non-empty list of core ids in [0, {total}), got {list(cpu_cores)}"
        )
    return cores


def _done(results: dict[str, Drafts]) -> Future[dict[str, Drafts]]:
    fut: Future[dict[str, Drafts]] = Future()
    fut.set_result(results)
    return fut
