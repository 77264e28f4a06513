"""A step plan's rows as NumPy arrays: what the runners' input builders index instead of walking rows and tokens.

A runner builds its forward's inputs (positions, KV slots, block tables, query positions) between sampling and the
launch: host time the device waits for. Built token by token in Python lists and converted with `torch.tensor`, a
256-row step took 3.5-7.8 ms (eager inputs, each attention path) and 2.2-7.9 ms (CUDA-graph inputs, tables padded to
129-513 blocks) on an AMD EPYC core (`python scripts/bench_launch_inputs.py`, docs/benchmarks.md): 11-39 % of a
20 ms accelerator step. Here the rows are read in one Python pass (`plan_rows`) and each per-token or per-block list
is one vectorised NumPy expression over the per-row arrays: 0.5-0.6 ms, 0.37-0.41 with the block tables read ahead
(`prepare_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.core.plan import ScheduledRequest, StepPlan


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


@dataclass(frozen=True)
class PreparedBlocks:
    """A plan's block tables read ahead (scheduling ahead: while the forward before it runs), for `plan_rows` at
    the launch: the block lists are most of what a launch reads (0.31 of 0.36 ms at 256 rows, AMD EPYC). A row's
    table is replaced, never changed in place, once scheduled (`ScheduledRequest.block_table`): rows that left the
    plan, or whose table was replaced since (rejected drafts' blocks released, a redraft's added), are read again."""

    index: dict[int, int]  # id(row) -> its index when read
    tables: list[list[int]]  # each row's table (the list itself) when read
    lens: np.ndarray  # [B] int64: their lengths
    blocks: np.ndarray  # [sum(lens)] int64: the tables, concatenated


def prepare_blocks(requests: Sequence[ScheduledRequest]) -> PreparedBlocks:
    """The rows' block tables, read now."""
    tables = [r.block_table for r in requests]
    lens = np.array([len(t) for t in tables], dtype=np.int64)
    blocks: list[int] = []
    for t in tables:
        blocks += t
    return PreparedBlocks({id(r): i for i, r in enumerate(requests)}, tables, lens, np.array(blocks, dtype=np.int64))


class BlocksAhead:
    """A runner's read-ahead: the next plan's block tables read by `prepare` (while the forward before it runs),
    used by `rows` at its launch."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ahead: tuple[StepPlan, PreparedBlocks] | None = None

    def prepare(self, plan: StepPlan) -> None:
        self._ahead = (plan, prepare_blocks(plan.requests))

    def rows(self, plan: StepPlan) -> PlanRows:
        """`plan_rows` of `plan`, with its tables read ahead when `prepare` read them for it (then forgotten)."""
        ahead, self._ahead = self._ahead, None
        return plan_rows(plan.requests, self.block_size, ahead[1] if ahead is not None and ahead[0] is plan else None)


def plan_rows(requests: Sequence[ScheduledRequest], block_size: int, prepared: PreparedBlocks | None = None) -> PlanRows:
    """The arrays of `requests`, read in one pass over the rows (the launch's critical path); the block tables
    gathered from `prepared` where it holds them."""
    starts: list[int] = []
    counts: list[int] = []
    wanted: list[int] = []
    ids: list[int] = []
    for r in requests:
        n = len(r.input_ids)
        starts.append(r.start_pos)
        counts.append(n)
        wanted.append(n if r.all_logits else (r.num_draft_tokens + 1 if r.needs_logits else 0))
        ids += r.input_ids
    starts_a, counts_a = np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64)
    used = (starts_a + counts_a + block_size - 1) // block_size
    blocks = _used_blocks(requests, used, prepared) if prepared is not None else _read_blocks(requests, used)
    return PlanRows(block_size, starts_a, counts_a, np.array(wanted, dtype=np.int64), used,
                    np.array(ids, dtype=np.int64), blocks)


def _read_blocks(requests: Sequence[ScheduledRequest], used: np.ndarray) -> np.ndarray:
    """[sum(used)] int64: each row's first `used` blocks, concatenated."""
    blocks: list[int] = []
    for r, u in zip(requests, used.tolist(), strict=True):
        blocks += r.block_table[:u]
    return np.array(blocks, dtype=np.int64)


def _used_blocks(requests: Sequence[ScheduledRequest], used: np.ndarray, prepared: PreparedBlocks) -> np.ndarray:
    """`_read_blocks`, gathered from `prepared`; rows it lacks, or whose table was replaced since, read again."""
    index, tables, where = prepared.index, prepared.tables, []
    for r in requests:
        w = index.get(id(r), -1)
        where.append(w if w >= 0 and r.block_table is tables[w] else -1)
    at = np.array(where, dtype=np.int64)  # [B]
    first = (np.cumsum(prepared.lens) - prepared.lens)[np.maximum(at, 0)]  # [B]
    stale = np.flatnonzero(at < 0)
    source = prepared.blocks
    if len(stale):  # their current tables appended to the source
        first[stale] = len(source) + np.cumsum(used[stale]) - used[stale]
        source = np.concatenate([source, _read_blocks([requests[i] for i in stale.tolist()], used[stale])])
    rows = np.repeat(np.arange(len(used), dtype=np.int64), used)
    within = np.arange(int(used.sum()), dtype=np.int64) - (np.cumsum(used) - used)[rows]
    return source[first[rows] + within]


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: the KV slot of each token (`rows` [T] its row of `tables` [B, W], `positions` [T])."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


def query_positions(starts: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """[B, q_max] int64: row i's queries at starts[i] + j, the padding past its counts[i] repeating the last."""
    return starts[:, None] + np.minimum(np.arange(q_max, dtype=np.int64)[None, :], counts[:, None] - 1)
