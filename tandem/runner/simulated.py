"""A runner that stands in for an accelerator, to size the CPU side at the batch sizes a GPU serves (benchmarks).

Its forward uses no CPU of the host's own work: `launch` returns at once and the step's logits are ready a step's
time later, as a device's kernels would be: `collect` sleeps until then (releasing the GIL) and reports that instant
as the finish. No thread completes the forward, so a busy host (a GIL held elsewhere) cannot make the device look
late: whatever the device waits is the host's lateness in calling `collect`, or in launching.

A step's time is fixed (`step_s`) or comes from a `DeviceModel` (runner/device_model.py: a named model on a named
accelerator, as a function of the tokens and KV positions in the step). The logits come from a `LogitsSource`:
  * `TableLogits`: a fixed table of random rows [table_rows, V] (bf16), row `last input token % table_rows` for
    each logits row, so a sampled token depends on the previous one and guided requests walk through their grammars
    the way a model would, with no model (a contiguous slice of the table when the rows fit: the "device" copies
    nothing on the host). Drafts are almost never accepted against it.
  * `ReplayLogits`: each request's recorded greedy continuation by a real model (`expect(request_id, tokens)`): the
    row at position p puts its maximum on that recording's token p + 1, so a greedy request emits exactly what the
    recorded model emitted and every draft is accepted or rejected as that model would. Its rows are written on a
    thread of their own during the forward (the GIL released), as a device would compute them.
Sampling still runs on the host (on a real accelerator it runs on the device): benchmarks count it as device time.
With `launch_inputs` (`CudaLaunchInputs`), `launch` first builds on the host what `ModelRunner.launch` builds for a
CUDA model before its forward can start (token ids, positions, slots, block tables; a CUDA graph's padded inputs
where the step fits one), read and built ahead by `prepare` as the runner does (runner/launch_inputs.py), so the
time a real device waits for it counts: at 256 verify rows 0.11 ms when rows were reshaped since its read (the read
patched and the step built in one call; 0.41-0.43 read again), 0.07 ms when it was only fed (AMD EPYC, 2026-12-06,
warm; 2.2-7.9 ms before core/plan_arrays.py; `python scripts/bench_launch_inputs.py`).
Not for serving: nothing it produces means anything.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from tandem.core.plan import StepPlan
from tandem.core.plan_arrays import PlanRows
from tandem.layers.attention import paged_step_inputs, step_inputs
from tandem.runner.base import ForwardHandle, Runner
from tandem.runner.cuda_graphs import GraphedSteps, capture_eagerly
from tandem.runner.device_model import DeviceModel
from tandem.runner.launch_inputs import EagerInputs, LaunchInputs, StepInputs

_SPIN_S = 0.0005  # the end of a wait for the forward is spun, as CUDA's default synchronisation does
RowKey = tuple[str, int, int]  # (request id, position of the row's input token, that token)
REPLAY_MARGIN = 40.0  # the recorded token's logit above the noise (std 3): the row's argmax by far
# replayed logits are written into one of this many buffers in turn: a forward's rows stay as they were until two
# more forwards have been built (the engine reads a forward's rows until the next one is launched and its checks end)
REPLAY_BUFFERS = 3


class LogitsSource(ABC):
    """Where a simulated forward's logits come from."""

    # the rows are built on the runner's own thread during the forward (a real tensor per step); else at collect
    builds_in_background = False

    @abstractmethod
    def rows(self, keys: Sequence[RowKey]) -> torch.Tensor:
        """Logits [len(keys), V] bf16, one row per (request, position, input token) in plan order."""

    def prepare(self, keys: Callable[[], Sequence[RowKey]]) -> Callable[[], torch.Tensor]:
        """At launch: `rows` of the keys `keys()` gives, to run on the runner's thread (the keys too: their Python
        work is off the launch's path)."""
        return lambda: self.rows(keys())

    def prepare_rows(self, rows: PlanRows) -> Callable[[], torch.Tensor]:
        """`prepare` of a plan read into its arrays `rows` (the keys taken from them on the runner's thread)."""
        return self.prepare(partial(_keys_of, rows))

    def reserve(self, rows: int) -> None:  # noqa: B027 - a source without buffers has nothing to size
        """Make room now for forwards of up to `rows` logits rows (before a measured run: none of it then)."""


class TableLogits(LogitsSource):
    """Random rows picked by the row's input token (see the module doc)."""

    def __init__(self, vocab_size: int, table_rows: int = 512, seed: int = 0, rows_by_token: bool = False) -> None:
        """rows_by_token: each row is table[last token % table_rows], so a request's logits depend on its own
        tokens alone, whatever else is in the batch (a copy per step; for tests comparing two runs). Otherwise
        a contiguous slice of the table when the rows fit (no copy; for benchmarks)."""
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(table_rows, vocab_size, generator=g) * 3.0).to(torch.bfloat16)  # [K, V]
        self.rows_by_token = rows_by_token

    def rows(self, keys: Sequence[RowKey]) -> torch.Tensor:
        last = [k[2] for k in keys]
        k, r = self.table.shape[0], len(last)
        if 2 * r <= k and not self.rows_by_token:  # a view: row i is table[start + i], start moved by the tokens just fed
            start = hash(tuple(last)) % (k - r)
            return self.table[start : start + r]  # [R, V] bf16
        return self.table.index_select(0, torch.tensor([t % k for t in last], dtype=torch.long))


class ReplayLogits(LogitsSource):
    """Rows that make a greedy request emit its recorded continuation (see the module doc). A request without a
    recording, or past its end, gets `end_token` as its maximum (e.g. EOS)."""

    builds_in_background = True

    def __init__(self, vocab_size: int, end_token: int, noise_rows: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.noise = (torch.randn(noise_rows, vocab_size, generator=g) * 3.0).to(torch.bfloat16)  # [K, V]
        self.end_token = end_token
        self._margin = torch.tensor(REPLAY_MARGIN, dtype=torch.bfloat16)
        self._expected: dict[str, Sequence[int]] = {}
        self._lock = threading.Lock()
        # `_recordings()`: the recordings end to end and where each is (made again after an `expect`)
        self._flat: tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray] | None = None
        # [capacity, V] bf16 each, row i = noise[i % K] but for the cells marked last time (rows, targets) [n] each
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * REPLAY_BUFFERS
        self._turn = 0

    def expect(self, request_id: str, tokens: Sequence[int]) -> None:
        """`tokens`: the request's prompt followed by the recorded model's output."""
        with self._lock:
            self._expected[request_id] = tokens
            self._flat = None

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)
            if self._flat is not None:
                self._flat[0].pop(request_id, None)

    def target(self, key: RowKey) -> int:
        """The token the recorded model put after the row's position."""
        tokens = self._expected.get(key[0])
        p = key[1] + 1
        return int(tokens[p]) if tokens is not None and p < len(tokens) else self.end_token

    def rows(self, keys: Sequence[RowKey]) -> torch.Tensor:
        return self._build(self._targets(keys))

    def prepare(self, keys: Callable[[], Sequence[RowKey]]) -> Callable[[], torch.Tensor]:
        # the recorded tokens are looked up on the runner's thread, as the device computes its rows: 0.2 ms at 256
        # rows that the launch's critical path no longer holds (a request that ends meanwhile gets `end_token` in a
        # row its engine throws away)
        return lambda: self._build(self._targets(keys()))

    def reserve(self, rows: int) -> None:
        """Every buffer of the ring `rows` rows big now: grown by the rows a forward asked for, a run whose verify
        rows climbed from 256 to ~700 copied 10-27 ms of noise rows ~20 times, 2 ms of a host core a step on
        average, beside the engine (AMD EPYC, 2026-12-06)."""
        k = self.noise.shape[0]
        for slot, held in enumerate(self._buffers):
            if held is None or held[0].shape[0] < rows:
                buf = self.noise.index_select(0, torch.arange(-(-rows // k) * k) % k)  # [capacity, V]
                empty = torch.zeros(0, dtype=torch.long)
                self._buffers[slot] = (buf, empty, empty)

    def prepare_rows(self, rows: PlanRows) -> Callable[[], torch.Tensor]:
        return lambda: self._build(self._targets_of(rows))

    def _targets_of(self, rows: PlanRows) -> torch.Tensor:
        """`_targets` of a plan's logits rows from its arrays `rows`: a lookup a request, the rows in NumPy (a key a
        row took this thread 0.16 ms a step and their lookups 0.18 at 256 verify rows, the GIL held beside the
        engine's own work: AMD EPYC, 2026-12-06)."""
        wanted = rows.logits_rows()  # [R]
        ahead = rows.positions()[wanted] + 1  # [R] the position of the token each row predicts
        with self._lock:
            index, offsets, lengths, flat = self._recordings()
            which = np.array([index.get(rid, -1) for rid in rows.request_ids], dtype=np.int64)  # [B]
        which = which[rows.row_of_tokens()[wanted]]  # [R] each row's recording (-1: none, its length 0)
        inside = ahead < lengths[which]
        out = np.full(len(wanted), self.end_token, dtype=np.int64)
        out[inside] = flat[offsets[which[inside]] + ahead[inside]]
        return torch.from_numpy(out)

    def _recordings(self) -> tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray]:
        """(Under the lock.) Each request's recording number, the recordings' offsets and lengths [n + 1] (the last
        an empty one, for -1), and the recordings end to end [N] int64."""
        if self._flat is None:
            tokens = list(self._expected.values())
            lengths = np.array([len(t) for t in tokens] + [0], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
            flat = np.fromiter((int(t) for seq in tokens for t in seq), np.int64, count=int(lengths.sum()))
            self._flat = ({rid: i for i, rid in enumerate(self._expected)}, offsets, lengths, flat)
        return self._flat

    def _targets(self, keys: Sequence[RowKey]) -> torch.Tensor:
        with self._lock:
            return torch.tensor([self.target(key) for key in keys], dtype=torch.long)  # [R]

    def _build(self, index: torch.Tensor) -> torch.Tensor:
        """Rows [R, V] bf16 whose argmax is `index` [R]: the next buffer of the ring with last time's marks undone
        and these set. A copy of R noise rows a forward took 5.6 ms of a core at 256 rows of 49,152 (AMD EPYC),
        CPU a real device does not take from the host: R cells now."""
        r = index.shape[0]
        slot = self._turn
        self._turn = (slot + 1) % REPLAY_BUFFERS
        held = self._buffers[slot]
        if held is None or held[0].shape[0] < r:
            k = self.noise.shape[0]
            buf = self.noise.index_select(0, torch.arange(-(-r // k) * k) % k)  # [capacity, V]
        else:
            buf, rows, cols = held
            # index_put_, not scatter_: bf16 scatter_ over rows this wide took 30 ms for 256 rows (index_put_ 0.01 ms)
            buf.index_put_((rows, cols), self.noise[rows % self.noise.shape[0], cols])
        rows = torch.arange(r)
        buf.index_put_((rows, index), self._margin)
        self._buffers[slot] = (buf, rows, index)
        return buf[:r]


class SimulatedRunner(Runner):
    """A device whose forward takes a step's time (fixed or modelled) and no host CPU."""

    def __init__(self, vocab_size: int, num_blocks: int, step_s: float = 0.0, table_rows: int = 512, seed: int = 0,
                 rows_by_token: bool = False, device_model: DeviceModel | None = None,
                 logits: LogitsSource | None = None, launch_inputs: CudaLaunchInputs | None = None) -> None:
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.kv_cache_bytes = 0
        self.step_s = step_s
        self.device_model = device_model
        self.vocab_size = vocab_size
        self.logits = logits or TableLogits(vocab_size, table_rows, seed, rows_by_token)
        self._lock = threading.Lock()
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="simulated-device") if self.logits.builds_in_background else None
        self.num_forwards = 0
        self.device_s = 0.0  # the forwards' modelled time, summed
        self.late_s = 0.0  # how much later than modelled the logits were built, summed
        self._free_at = 0.0  # when the last forward launched ends: a device runs its forwards one after another
        self.first_launch_at: float | None = None  # perf_counter() of the first launch since it was last set to None
        self.launch_inputs = launch_inputs  # the host's part of a real launch, built and dropped (see the module doc)

    @property
    def forward_uses_host_cores(self) -> bool:
        return False  # the simulated device sleeps

    def forward_s(self, plan: StepPlan, rows: PlanRows | None = None) -> float:
        """This plan's forward time (from its arrays `rows` when given): the device model's, else the fixed step."""
        if self.device_model is None:
            return self.step_s
        return self.device_model.plan_s(plan) if rows is None else self.device_model.rows_s(rows.starts, rows.counts)

    @property
    def launches_unsettled(self) -> bool:
        return self.launch_inputs is not None and self.launch_inputs.ahead.patches

    def prepare(self, plan: StepPlan) -> None:
        if self.launch_inputs is not None:
            self.launch_inputs.prepare(plan)

    def launch(self, plan: StepPlan) -> ForwardHandle:
        """The forward 'runs' for its step time from now, or from the end of the forward before it when that one
        still runs (one thrown away uncollected: a stream runs its kernels in order), once its inputs are built (with
        `launch_inputs`); its logits rows are built meanwhile (or at collect)."""
        if self.launch_inputs is not None:  # the row keys come from its arrays, off the launch's path
            rows = self.launch_inputs(plan)[0]
            keys, seconds = partial(_keys_of, rows), self.forward_s(plan, rows)
            build = partial(self.logits.prepare_rows, rows)
        else:  # (the plan's rows change after the launch)
            keys, seconds = partial(list, _row_keys(plan)), self.forward_s(plan)
            build = partial(self.logits.prepare, keys)
        with self._lock:
            self.num_forwards += 1
            self.device_s += seconds
        built = self._builder.submit(_timed, build()) if self._builder is not None else None
        # the device runs from here; the handle's bookkeeping is host work beside it, as after a real runner's submit
        now = time.perf_counter()
        if self.first_launch_at is None:
            self.first_launch_at = now
        ready_at = self._free_at = max(now, self._free_at) + seconds
        return _SimulatedHandle(Future(), ready_at=ready_at, keys=keys, built=built)

    def collect(self, handle: ForwardHandle) -> torch.Tensor:
        """Sleep until the forward is done (at once if it is already), then its logits [R, V] bf16."""
        assert isinstance(handle, _SimulatedHandle), "a handle of another runner"
        if not handle.future.done():
            _sleep_until(handle.ready_at)
            if handle.built is not None:
                logits, built_at = handle.built.result()
                done = max(handle.ready_at, built_at)  # rows not built in time: a late device
                # (the builder thread waits for the GIL behind the host's Python work: the simulator's own cost,
                # which a real device does not have; benchmarks subtract it)
                self.late_s += done - handle.ready_at
            else:
                logits, done = self.logits.rows(handle.keys()), handle.ready_at
            handle.future.set_result((logits, done))
        return super().collect(handle)

    def shutdown(self) -> None:
        if self._builder is not None:
            self._builder.shutdown(wait=True)


class CudaLaunchInputs(LaunchInputs):
    """What `ModelRunner.launch` builds on the host before a CUDA model's forward starts (FlexAttention's paged
    decode; a CUDA graph's padded inputs when the step fits one), on the CPU, read and built ahead as the runner
    does (runner/launch_inputs.py): a call costs the host what a real launch does, less the page-locked copies."""

    def __init__(self, block_size: int, max_model_len: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.graphs = GraphedSteps(forward=lambda ids, meta: ids, capture=capture_eagerly, device=torch.device("cpu"),
                                   block_size=block_size, scratch_block=num_blocks,
                                   max_blocks=min(-(-max_model_len // block_size) + 1, num_blocks))
        self._captured: set[tuple[int, int]] = set()  # the graphs a real runner would hold by now
        self._capturing = False
        super().__init__(block_size, torch.device("cpu"), lambda: self.graphs, self._paged,
                         build_ahead=lambda: not self._capturing,
                         eager_from_op=lambda rows, out: paged_step_inputs(rows, out, torch.device("cpu")))

    def __call__(self, plan: StepPlan) -> tuple[PlanRows, StepInputs]:
        rows, inputs = super().__call__(plan)
        key = inputs.graph.key if inputs.graph is not None else None
        self._capturing = key is not None and key not in self._captured  # a real runner captures it first
        if key is not None:
            self._captured.add(key)
        return rows, inputs

    def _paged(self, plan: StepPlan, rows: PlanRows) -> EagerInputs:
        return step_inputs(plan, self.block_size, torch.device("cpu"), gathered_decode=False, paged_decode=True,
                           rows=rows)


def _keys_of(rows: PlanRows) -> list[RowKey]:
    """`_row_keys` from a plan's arrays."""
    wanted = rows.logits_rows()  # [R]
    names = rows.request_ids
    return [(names[i], p, t) for i, p, t in zip(rows.row_of_tokens()[wanted].tolist(), rows.positions()[wanted].tolist(),
                                                rows.input_ids[wanted].tolist(), strict=True)]


def _row_keys(plan: StepPlan) -> list[RowKey]:
    """(request, position, input token) of each logits row, in plan order (the launch's critical path: a row of
    one logits row, the usual one, is taken without a loop)."""
    keys: list[RowKey] = []
    for r in plan.requests:
        n = r.num_logits_rows
        if n == 1:
            keys.append((r.request_id, r.start_pos + r.num_tokens - 1, r.input_ids[-1]))
        elif n:
            keys.extend((r.request_id, r.start_pos + j, r.input_ids[j]) for j in range(r.num_tokens - n, r.num_tokens))
    return keys


def _timed(build: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """`build()` and the instant it was done."""
    out = build()
    return out, time.perf_counter()


def _sleep_until(t: float, clock: Callable[[], float] = time.perf_counter) -> None:
    time.sleep(max(0.0, t - _SPIN_S - clock()))
    while clock() < t:  # sleep wakes ~0.2 ms late here; a device sync spins
        pass


@dataclass
class _SimulatedHandle(ForwardHandle):
    ready_at: float = 0.0  # perf_counter() when the simulated forward is done
    keys: Callable[[], list[RowKey]] = list  # (request, position, input token) of each logits row
    built: Future[tuple[torch.Tensor, float]] | None = None
