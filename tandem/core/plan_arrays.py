"""A step plan's rows as NumPy arrays: what the runners' input builders index instead of walking rows and tokens.

A runner builds its forward's inputs (positions, KV slots, block tables, query positions) between sampling and the
launch: host time the device waits for. Built token by token in Python lists and converted with `torch.tensor`, a
256-row step took 3.5-7.8 ms (eager inputs, each attention path) and 2.2-7.9 ms (CUDA-graph inputs, tables padded to
129-513 blocks) on an AMD EPYC core (`python scripts/bench_launch_inputs.py`, docs/benchmarks.md): 11-39 % of a
20 ms accelerator step. Here the rows are read in one Python pass (`plan_rows`) and each per-token or per-block list
is one vectorised NumPy expression over the per-row arrays: 0.5-0.6 ms. Scheduling ahead, the rows are read while
the forward before runs and only those the scheduler changed since are read at the launch (`InputsAhead`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import numpy as np

from tandem.core.plan import ScheduledRequest, StepPlan

Built = TypeVar("Built")  # a runner's launch inputs
# a read's arrays and the plan's edits since, flat (`_Read.edits_flat`) -> the plan's arrays now, and its launch
# inputs where the runner built them in the same call (a runner's op)
Patch = Callable[["PlanRows", list[int]], "tuple[PlanRows, Built | None]"]
HELD_TO_BUILD = 0.5  # inputs are built ahead while at least this share of recent reads held to their launch
HELD_RATE = 0.1  # how fast that share follows: ~10 launches


@dataclass(frozen=True)
class PlanRows:
    """A plan's requests as arrays, in plan order (B rows, T tokens), for blocks of `block_size` tokens."""

    block_size: int
    starts: np.ndarray  # [B] int64: tokens cached before the row's first input (its first position)
    counts: np.ndarray  # [B] int64: the row's input tokens
    wanted: np.ndarray  # [B] int64: the row's logits rows (its last ones)
    used: np.ndarray  # [B] int64: the blocks its positions reach (its last position's block + 1)
    input_ids: np.ndarray  # [T] int64: the rows' input ids, concatenated
    blocks: np.ndarray  # [sum(used)] int64: each row's first `used` blocks, concatenated
    request_ids: list[str]  # [B]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def offsets(self) -> np.ndarray:
        """[B] int64: each row's first token in the flattened batch."""
        return np.cumsum(self.counts) - self.counts

    def positions(self) -> np.ndarray:
        """[T] int64: each flattened token's position."""
        return np.repeat(self.starts - self.offsets, self.counts) + np.arange(self.num_tokens, dtype=np.int64)

    def row_of_tokens(self) -> np.ndarray:
        """[T] int64: each flattened token's row."""
        return np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts)

    def tables(self, width: int) -> np.ndarray:
        """[B, width] int64: row i's `used[i]` blocks, then its last one repeated (`width` >= max(used)). Each row
        is filled with its last block, then the blocks before it scattered in: a gather over all B x width cells
        took 5x longer at the CUDA graphs' 513-block width."""
        used, first = self.used, np.cumsum(self.used) - self.used
        out = np.empty((len(used), width), dtype=np.int64)
        out[:] = self.blocks[first + used - 1][:, None]
        rows = np.repeat(np.arange(len(used), dtype=np.int64), used)
        out[rows, np.arange(len(self.blocks), dtype=np.int64) - first[rows]] = self.blocks
        return out

    def logits_rows(self) -> np.ndarray:
        """[R] int64: the flattened batch's rows whose logits are wanted, each row's last `wanted`."""
        first = np.cumsum(self.wanted) - self.wanted
        ends = self.offsets + self.counts
        return np.repeat(ends - self.wanted - first, self.wanted) + np.arange(int(self.wanted.sum()), dtype=np.int64)


class InputsAhead(Generic[Built]):
    """A runner's read-ahead of the next plan (scheduling ahead): `prepare` reads its rows into arrays, and builds
    the launch's inputs from them when given `build`, while the forward before it runs. At its launch, `take` uses
    that read when the scheduler only fed tokens into the plan since (`StepPlan.edits`): the input ids patched, the
    rest as read (and `with_ids` puts the ids into the inputs built). Rows reshaped: the runner's `patch` puts them
    into the read (else the plan is read again), and the inputs are built at the launch (by the patch itself where
    it can); rows withdrawn: the plan is read again. After the host's sampling has streamed a step's logits through
    the caches, a launch's NumPy calls cost ~10x their warm time: a 256-row CUDA launch read again took 0.56-0.61 ms
    warm, 1.16-1.75 ms cold, one only fed 0.08-0.09 / 0.42-0.47 (AMD EPYC, 2026-12-06, `python
    scripts/bench_launch_inputs.py [--cold]`)."""

    def __init__(self, block_size: int, build: Callable[[StepPlan, PlanRows], Built] | None = None,
                 with_ids: Callable[[Built, PlanRows], Built] | None = None, patch: Patch[Built] | None = None) -> None:
        """build: a runner's launch inputs from a plan's arrays; with_ids: those inputs with other input ids; patch:
        the arrays of a plan with rows reshaped since its read, from the read and the edits (else read again), and
        its inputs when the runner built them in the same call."""
        self.block_size = block_size
        self._build, self._with_ids, self._patch = build, with_ids, patch
        self._ahead: _Read[Built] | None = None
        # the share of recent reads a launch took as read (EWMA): with drafts, most plans are reshaped after their
        # read (optimistic misses), and inputs built for them would only take the host's time
        self.held_share = 1.0

    @property
    def patches(self) -> bool:
        """Whether `take` puts a plan's edits into its read (the runner has a `patch`): a plan read may then be
        launched with the outcome of the plan before it still to come into its rows (`PlanEdits.outcome`)."""
        return self._patch is not None

    @property
    def read(self) -> PlanRows | None:
        """The arrays of the plan read ahead (None: none held)."""
        return self._ahead.arrays if self._ahead is not None else None

    def prepare(self, plan: StepPlan, build: bool = True) -> None:
        """Read `plan` now (and build its inputs, given `build` and a builder, while most reads hold)."""
        rows = list(plan.requests)
        arrays = plan_rows(rows, self.block_size)
        builder = self._build if build and self.held_share >= HELD_TO_BUILD else None
        built = builder(plan, arrays) if builder is not None else None
        self._ahead = _Read(plan, rows, {id(r): i for i, r in enumerate(rows)}, arrays, built)

    def take(self, plan: StepPlan) -> tuple[PlanRows, Built | None]:
        """`plan_rows(plan.requests)`, and the inputs built from them when the read ahead built them (else None),
        from the read `prepare` made of `plan` if it holds (then forgotten): fed tokens put in; rows reshaped since
        put in by `patch` where the runner has one (which may build the inputs too), as is the outcome of the plan
        before when `plan` is launched before its `settle`; the plan read again when rows were withdrawn."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.plan is not plan:
            assert plan.edits.outcome is None, "a plan launched before settle needs its read and a patch"
            return plan_rows(plan.requests, self.block_size), None
        fed = ahead.fed(plan)
        self.held_share += HELD_RATE * ((fed is not None) - self.held_share)
        # an outcome that only feeds tokens takes the inputs built ahead; none built, the patch builds them in one call
        if fed is not None and (plan.edits.outcome is None or ahead.built is not None):
            rows = replace(ahead.arrays, input_ids=ahead.ids_with(fed))
            built = ahead.built
            return rows, (self._with_ids(built, rows) if built is not None and self._with_ids is not None else None)
        patch = self._patch
        edits = ahead.edits_flat(plan) if patch is not None else None
        if patch is not None and edits is not None:
            return patch(ahead.arrays, edits)
        assert plan.edits.outcome is None, "a plan launched before settle needs its read and a patch"
        return plan_rows(plan.requests, self.block_size), None


@dataclass(frozen=True)
class _Read(Generic[Built]):
    """A plan's rows as `InputsAhead.prepare` read them."""

    plan: StepPlan
    rows: list[ScheduledRequest]  # held, so that no other row takes one of their ids
    index: dict[int, int]  # id(row) -> its index in `rows`
    arrays: PlanRows
    built: Built | None

    def fed(self, plan: StepPlan) -> np.ndarray | None:
        """[F, 3] int64: the (row, index, token) that `plan.edits` fed (or its outcome, launched before `settle`,
        feeds) since this read; None when rows were reshaped or withdrawn since, or are by the outcome (see
        `edits_flat`). (An outcome that only feeds: every request's drafts accepted and kept, or none drafted.)"""
        edits, outcome = plan.edits, plan.edits.outcome
        if edits.reshaped or edits.withdrawn or len(plan.requests) != len(self.rows):
            return None
        if outcome is not None and len(outcome) != 1 + 3 * outcome[0]:  # rows reshaped by it
            return None
        return np.array(outcome[1:] if outcome is not None else edits.fed, dtype=np.int64).reshape(-1, 3)

    def ids_with(self, fed: np.ndarray) -> np.ndarray:
        """[T] int64: the read's input ids with the `fed` [F, 3] tokens put in (the read's own array when none)."""
        if not len(fed):
            return self.arrays.input_ids
        ids = self.arrays.input_ids.copy()
        ids[self.arrays.offsets[fed[:, 0]] + fed[:, 1]] = fed[:, 2]
        return ids

    def edits_flat(self, plan: StepPlan) -> list[int] | None:
        """`plan.edits` since this read as one list of ints (what a runner's `patch` takes: csrc/plan_ops.cpp's
        `plan_patch`): the fed count, the fed (row, index, token), then each reshaped row, ascending, as (row, start,
        tokens, logits rows, blocks used, its ids, its used blocks); None when rows were withdrawn or a reshaped row
        is not one read; `edits.outcome` as it is when the plan is launched before `settle`. (The same patch in
        NumPy, ~40 calls after the host's sampling has flushed the caches, took the launch 0.38-0.43 ms, more than
        reading the plan again: AMD EPYC, 2026-12-06.)"""
        edits = plan.edits
        if edits.withdrawn or len(plan.requests) != len(self.rows):
            return None
        if edits.outcome is not None:  # launched before `settle`: its rows unchanged since the read but for that
            assert not edits.fed and not edits.reshaped, "a plan launched before settle was changed before it"
            return edits.outcome
        index, bs = self.index, self.arrays.block_size
        reshaped: dict[int, ScheduledRequest] = {}
        for r in edits.reshaped:
            i = index.get(id(r))
            if i is None:
                return None
            reshaped[i] = r
        flat = [len(edits.fed)]
        for fed in edits.fed:
            flat += fed
        for i in sorted(reshaped):
            r = reshaped[i]
            n, start = len(r.input_ids), r.start_pos
            used = (start + n + bs - 1) // bs
            flat += (i, start, n, r.num_logits_rows, used)
            flat += r.input_ids
            flat += r.block_table[:used]
        return flat


def plan_rows(requests: Sequence[ScheduledRequest], block_size: int) -> PlanRows:
    """The arrays of `requests`, read in one pass over the rows (at a launch that reads a plan again it runs on
    caches the host's sampling has just flushed, where a NumPy call costs ~10x its warm time: one loop, one array
    per field)."""
    starts: list[int] = []
    counts: list[int] = []
    wanted: list[int] = []
    used: list[int] = []
    ids: list[int] = []
    blocks: list[int] = []
    names: list[str] = []
    for r in requests:
        n, start = len(r.input_ids), r.start_pos
        u = (start + n + block_size - 1) // block_size
        starts.append(start)
        counts.append(n)
        wanted.append(n if r.all_logits else (r.num_draft_tokens + 1 if r.needs_logits else 0))
        used.append(u)
        ids += r.input_ids
        blocks += r.block_table[:u]
        names.append(r.request_id)

    def a(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return PlanRows(block_size, a(starts), a(counts), a(wanted), a(used), a(ids), a(blocks), names)


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: the KV slot of each token (`rows` [T] its row of `tables` [B, W], `positions` [T])."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


def query_positions(starts: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """[B, q_max] int64: row i's queries at starts[i] + j, the padding past its counts[i] repeating the last."""
    return starts[:, None] + np.minimum(np.arange(q_max, dtype=np.int64)[None, :], counts[:, None] - 1)
