"""A step plan's rows as NumPy arrays: what the runners' input builders index instead of walking rows and tokens.

A runner builds its forward's inputs (positions, KV slots, block tables, query positions) between sampling and the
launch: host time the device waits for. Built token by token in Python lists and converted with `torch.tensor`, a
256-row decode step took 2-5 ms (eager metadata) and 2.4-8.5 ms (CUDA-graph inputs, tables padded to 129-513 blocks)
on an AMD EPYC core (`python scripts/bench_launch_inputs.py`, docs/benchmarks.md): 12-42 % of a 20 ms accelerator
step. Here the rows are read in one Python pass (`plan_rows`) and each per-token or per-block list is
one vectorised NumPy expression over the per-row arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.core.plan import ScheduledRequest


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


def plan_rows(requests: Sequence[ScheduledRequest], block_size: int) -> PlanRows:
    """The arrays of `requests`, read in one pass over the rows (the launch's critical path)."""
    starts: list[int] = []
    counts: list[int] = []
    wanted: list[int] = []
    used: list[int] = []
    ids: list[int] = []
    blocks: list[int] = []
    for r in requests:
        s, inputs = r.start_pos, r.input_ids
        n = len(inputs)
        u = (s + n + block_size - 1) // block_size
        starts.append(s)
        counts.append(n)
        used.append(u)
        wanted.append(n if r.all_logits else (r.num_draft_tokens + 1 if r.needs_logits else 0))
        ids += inputs
        blocks += r.block_table[:u]
    return PlanRows(block_size, *(np.array(x, dtype=np.int64) for x in (starts, counts, wanted, used, ids, blocks)))


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: the KV slot of each token (`rows` [T] its row of `tables` [B, W], `positions` [T])."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


def query_positions(starts: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """[B, q_max] int64: row i's queries at starts[i] + j, the padding past its counts[i] repeating the last."""
    return starts[:, None] + np.minimum(np.arange(q_max, dtype=np.int64)[None, :], counts[:, None] - 1)
