"""A step plan's rows as NumPy arrays: what the runners' input builders index instead of walking rows and tokens.

A runner builds its forward's inputs (positions, KV slots, block tables, query positions) between sampling and the
launch: host time the device waits for. Built token by token in Python lists and converted with `torch.tensor`, a
256-row decode step took 2-5 ms (eager metadata) and 2.4-8.5 ms (CUDA-graph inputs, tables padded to 129-513 blocks)
on an AMD EPYC core (`python scripts/bench_launch_inputs.py`, docs/benchmarks.md): 12-42 % of a 20 ms accelerator
step. Here each per-token or per-block list is one vectorised NumPy expression over per-row arrays; the lists are
read once (`np.fromiter` over the rows' own lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from tandem.core.plan import ScheduledRequest


@dataclass(frozen=True)
class PlanRows:
    """Per-row arrays of a plan's requests, in plan order (B rows, T tokens)."""

    starts: np.ndarray  # [B] int64: tokens cached before the row's first input (its first position)
    counts: np.ndarray  # [B] int64: the row's input tokens
    offsets: np.ndarray  # [B] int64: the row's first token in the flattened batch

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    def positions(self) -> np.ndarray:
        """[T] int64: each flattened token's position."""
        t = self.num_tokens
        return np.repeat(self.starts - self.offsets, self.counts) + np.arange(t, dtype=np.int64)

    def row_of_tokens(self) -> np.ndarray:
        """[T] int64: each flattened token's row."""
        return np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts)

    def blocks_used(self, block_size: int) -> np.ndarray:
        """[B] int64: the blocks each row's positions reach (its last position's block + 1)."""
        return (self.starts + self.counts + block_size - 1) // block_size


def plan_rows(requests: Sequence[ScheduledRequest]) -> PlanRows:
    """The arrays of `requests` (one pass over the rows)."""
    b = len(requests)
    starts = np.fromiter((r.start_pos for r in requests), np.int64, count=b)
    counts = np.fromiter((len(r.input_ids) for r in requests), np.int64, count=b)
    return PlanRows(starts, counts, np.cumsum(counts) - counts)


def flat_input_ids(requests: Sequence[ScheduledRequest], num_tokens: int) -> np.ndarray:
    """[T] int64: the rows' input ids, concatenated."""
    return np.fromiter(chain.from_iterable(r.input_ids for r in requests), np.int64, count=num_tokens)


def padded_tables(tables: Sequence[Sequence[int]], used: np.ndarray, width: int) -> np.ndarray:
    """[B, width] int64: row i is `tables[i][:used[i]]` then its last entry repeated (every `used[i]` >= 1 and
    <= len(tables[i]); `width` >= max(used)). Each row is filled with its last entry, then the entries before it
    are scattered in: a gather over all B x width cells took 5x longer at the CUDA graphs' 513-block width."""
    total = int(used.sum())
    flat = np.fromiter(chain.from_iterable(t[:u] for t, u in zip(tables, used.tolist(), strict=True)), np.int64,
                       count=total)
    first = np.cumsum(used) - used
    out = np.empty((len(used), width), dtype=np.int64)
    out[:] = flat[first + used - 1][:, None]
    rows = np.repeat(np.arange(len(used), dtype=np.int64), used)
    out[rows, np.arange(total, dtype=np.int64) - first[rows]] = flat
    return out


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: the KV slot of each token (`rows` [T] its row of `tables` [B, W], `positions` [T])."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


def query_positions(starts: np.ndarray, counts: np.ndarray, q_max: int) -> np.ndarray:
    """[B, q_max] int64: row i's queries at starts[i] + j, the padding past its counts[i] repeating the last."""
    return starts[:, None] + np.minimum(np.arange(q_max, dtype=np.int64)[None, :], counts[:, None] - 1)


def logits_rows(requests: Sequence[ScheduledRequest], rows: PlanRows) -> np.ndarray:
    """[R] int64: the flattened batch's rows whose logits are wanted, each request's last `num_logits_rows`."""
    wanted = np.fromiter((r.num_logits_rows for r in requests), np.int64, count=len(requests))
    first = np.cumsum(wanted) - wanted
    ends = rows.offsets + rows.counts
    return np.repeat(ends - wanted - first, wanted) + np.arange(int(wanted.sum()), dtype=np.int64)
