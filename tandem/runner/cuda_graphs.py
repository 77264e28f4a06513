"""CUDA graphs for decode and verification steps: one kernel-graph launch per step instead of ~10 launches a layer.

A step qualifies when every request feeds the same number q of new tokens (1 when decoding, 1 + K when verifying K
drafts) after cached ones, wants a logits row for each, and the paged decode attention (`layers/paged_decode.py`)
is on: then the step's whole forward is a fixed sequence of kernels for its shape. Its batch is padded up to a
bucket (1, 2, 4, ..., 256) and one graph is captured per (bucket, q) on first use, reading from static buffers:
token ids, positions, KV slots, block counts, block tables (padded to the longest a request can hold), query
positions; its logits land in a static output. Each later step of that shape copies its inputs into the buffers
(from page-locked memory, non-blocking) and replays. Padding rows are requests of one token that write their K/V
into a scratch block the runner reserves beyond the scheduler's blocks and read only that block.

`capture` is the seam: on CUDA it warms the step up on a side stream and captures it into a `torch.cuda.CUDAGraph`
(all graphs share one memory pool); tests on the host pass an eager stand-in that records the same bookkeeping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from tandem.core.plan import StepPlan
from tandem.core.plan_arrays import PlanRows, query_positions, slot_mapping
from tandem.layers.attention import DECODE_MAX_QUERY, AttentionMetadata, DecodeGroup
from tandem.layers.paged_decode import PagedDecode

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_TOKENS = 1024  # bucket x q at most: the static logits of a bigger graph would cost more than it saves
_NONE = torch.empty(0, dtype=torch.long)


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs on for a CUDA runner unless TANDEM_CUDA_GRAPHS=0; =1 turns the same path on for any device
    (off CUDA with the eager stand-in: the device check's dry run exercises the bookkeeping so)."""
    choice = os.environ.get("TANDEM_CUDA_GRAPHS", "auto")
    return choice == "1" or (choice != "0" and device.type == "cuda")


def bucket_for(batch: int, q: int) -> int | None:
    """The smallest bucket holding `batch` requests of `q` tokens, None when the step is too big for a graph."""
    for b in BUCKETS:
        if b >= batch:
            return b if b * q <= MAX_GRAPH_TOKENS else None
    return None


def _query_len(rows: PlanRows) -> int | None:
    """`graph_query_len` of a plan from its arrays."""
    counts = rows.counts
    if not len(counts):
        return None
    q = int(counts[0])
    if q > DECODE_MAX_QUERY or (counts != q).any() or (rows.starts == 0).any() or (rows.wanted != q).any():
        return None
    return q


def graph_query_len(plan: StepPlan) -> int | None:
    """q when every request of `plan` feeds q cached-after tokens and wants all their logits rows; else None."""
    reqs = plan.requests
    if not reqs:
        return None
    q = reqs[0].num_tokens
    if q > DECODE_MAX_QUERY:
        return None
    for r in reqs:
        if r.num_tokens != q or r.start_pos == 0 or r.num_logits_rows != q:
            return None
    return q


@dataclass
class GraphInputs:
    """One step's inputs on the host (page-locked on CUDA), padded to its bucket."""

    key: tuple[int, int]  # (bucket, q)
    num_rows: int  # real logits rows: batch x q
    input_ids: torch.Tensor  # [bucket * q] int64
    positions: torch.Tensor  # [bucket * q] int64
    slots: torch.Tensor  # [bucket * q] int64
    num_blocks: torch.Tensor  # [bucket] int32
    block_tables: torch.Tensor  # [bucket, max_blocks] int32
    query_pos: torch.Tensor  # [bucket, q] int64


@dataclass
class StaticStep:
    """The buffers one graph reads and writes; a step's inputs are copied in before each replay."""

    inputs: GraphInputs  # device tensors of the graph's shape
    meta: AttentionMetadata
    graph: Any = None  # what `capture` returned: has replay()
    logits: torch.Tensor | None = None  # [bucket * q, V] the graph's output
    replays: int = 0


@dataclass
class GraphedSteps:
    """Captured graphs by (bucket, q) and the steps they replay; `prepare` on the caller's thread, `run` on the
    tensor thread."""

    forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]  # (input_ids, meta) -> logits [T, V]
    capture: Callable[[Callable[[], torch.Tensor]], tuple[Any, torch.Tensor]]  # fn -> (graph, static output)
    device: torch.device
    block_size: int
    scratch_block: int  # a KV block no request holds: padding rows write and read only it
    max_blocks: int  # the most blocks one request can hold (its table's width in the graph)
    steps: dict[tuple[int, int], StaticStep] = field(default_factory=dict)

    @property
    def captures(self) -> int:
        return len(self.steps)

    def prepare(self, plan: StepPlan, rows: PlanRows) -> GraphInputs | None:
        """The step's padded inputs when it fits a graph (`rows`: its arrays, `plan_rows`); None when it runs
        eagerly."""
        return self.pad(rows, _query_len(rows))

    def pad(self, rows: PlanRows, q: int | None) -> GraphInputs | None:
        """`prepare` for a plan whose `_query_len` is known (`q`; 0 or None: not a graph's shape)."""
        if not q:
            return None
        bucket = bucket_for(len(rows.counts), q)
        if bucket is None or int(rows.used.max()) > self.max_blocks:  # the graph's tables hold the blocks it reads
            return None
        return self._pad(rows, bucket, q)

    def _pad(self, rows: PlanRows, bucket: int, q: int) -> GraphInputs:
        """The step's inputs padded to `bucket` requests of `q` tokens each, vectorised over the rows (the launch
        waits for this: core/plan_arrays.py). Padding requests hold one block (the scratch), their keys at position
        0, queries at 0."""
        bs, scratch, n, width = self.block_size, self.scratch_block, len(rows.counts), self.max_blocks
        held = rows.used  # [n]
        ids = np.zeros(bucket * q, dtype=np.int64)
        ids[: n * q] = rows.input_ids
        qpos = np.zeros((bucket, q), dtype=np.int64)
        qpos[:n] = query_positions(rows.starts, rows.counts, q)  # every row feeds q tokens
        tables = np.full((bucket, width), scratch, dtype=np.int64)
        tables[:n] = rows.tables(width)
        counts = np.ones(bucket, dtype=np.int64)
        counts[:n] = held
        slots = np.empty((bucket, q), dtype=np.int64)
        slots[:n] = slot_mapping(tables, np.repeat(np.arange(n), q), qpos[:n].reshape(-1), bs).reshape(n, q)
        slots[n:] = scratch * bs + np.minimum(np.arange(q), bs - 1)
        t = self._host_tensor
        return GraphInputs((bucket, q), n * q, t(ids), t(qpos.reshape(-1).copy()), t(slots.reshape(-1)),
                           t(counts, torch.int32), t(tables, torch.int32), t(qpos))

    def with_ids(self, inputs: GraphInputs, ids: np.ndarray) -> GraphInputs:
        """`inputs` with the token ids `ids` [n * q] (the step's rows and shape unchanged), padded as `_pad` pads."""
        padded = np.zeros(inputs.input_ids.shape[0], dtype=np.int64)
        padded[: len(ids)] = ids
        return replace(inputs, input_ids=self._host_tensor(padded))

    def _host_tensor(self, values: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        return x.pin_memory() if self.device.type == "cuda" else x

    def run(self, inputs: GraphInputs) -> torch.Tensor:
        """Copy `inputs` into their graph's buffers (capturing it first when new), replay; logits [rows, V]."""
        step = self.steps.get(inputs.key)
        if step is None:
            step = self._static(inputs)
        else:
            self._fill(step.inputs, inputs)
        if step.graph is None:
            step.graph, step.logits = self.capture(lambda: self._forward(step))
        else:
            step.graph.replay()
        step.replays += 1
        assert step.logits is not None
        return step.logits[: inputs.num_rows].clone()

    def _forward(self, step: StaticStep) -> torch.Tensor:
        """The step's forward from its static buffers; the block mask is rebuilt inside it (captured with it)."""
        assert step.meta.decode is not None and step.meta.decode.paged is not None
        step.meta.decode.paged.masks.clear()
        return self.forward(step.inputs.input_ids, step.meta)

    def _static(self, inputs: GraphInputs) -> StaticStep:
        """Device buffers for a new (bucket, q), holding this step's inputs, and the metadata that reads them."""
        dev = GraphInputs(inputs.key, inputs.num_rows, *(
            getattr(inputs, f).to(self.device, non_blocking=True)
            for f in ("input_ids", "positions", "slots", "num_blocks", "block_tables", "query_pos")
        ))
        bucket, q = inputs.key
        paged = PagedDecode(dev.num_blocks, dev.block_tables, dev.query_pos, self.block_size)
        group = DecodeGroup(token_index=_NONE, key_blocks=_NONE, bias=_NONE, batch=bucket, q_max=q,
                            key_len=self.max_blocks * self.block_size, flat_index=_NONE, out_rows=_NONE,
                            seq_info=_NONE, block_tables=_NONE, dense=True, query_pos=dev.query_pos, paged=paged)
        meta = AttentionMetadata(bucket * q, dev.positions, dev.slots, decode=group)
        step = StaticStep(dev, meta)
        self.steps[inputs.key] = step
        return step

    @staticmethod
    def _fill(static: GraphInputs, inputs: GraphInputs) -> None:
        for f in ("input_ids", "positions", "slots", "num_blocks", "block_tables", "query_pos"):
            getattr(static, f).copy_(getattr(inputs, f), non_blocking=True)


def capture_cuda_graph(pool: Any) -> Callable[[Callable[[], torch.Tensor]], tuple[Any, torch.Tensor]]:
    """A capturer into `pool` (torch.cuda.graph_pool_handle()): two warm-up runs on a side stream (compilation,
    library workspaces; they write the same K/V the step writes), then the capture; the captured run's output
    is the graph's static output, and one replay computes this step's logits into it."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        graph.replay()  # a capture records without running: run it once for this step's logits
        return graph, out

    return capture


class EagerGraph:
    """The host's stand-in for a captured graph (tests): `replay` reruns the step into the same static output."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


def capture_eagerly(fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
    out = fn()
    return EagerGraph(fn, out), out
