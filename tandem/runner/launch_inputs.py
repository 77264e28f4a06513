"""What a runner builds on the host before a forward can start, and the read ahead that builds most of it early.

Between sampling and the next launch the device waits while the host builds the forward's inputs: a CUDA graph's
padded inputs when the step fits one (runner/cuda_graphs.py), else the eager inputs (`step_inputs`). Scheduling
ahead, `prepare` reads the next plan and, where the forward does not run on the host's own cores, builds its inputs
while the forward before it runs; at the launch only the fed token ids are put in when the scheduler fed tokens and
nothing else since (core/plan_arrays.InputsAhead). Shared by `ModelRunner` and the simulated device's stand-in for a
CUDA launch (runner/simulated.py), so that the benchmark pays what the runner pays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.plan import StepPlan
from tandem.core.plan_arrays import InputsAhead, PlanRows
from tandem.layers.attention import DECODE_MAX_QUERY, AttentionMetadata, host_ids
from tandem.layers.kernels import load_cpu_kernels
from tandem.runner.cuda_graphs import GraphedSteps, GraphInputs

EagerInputs = tuple[torch.Tensor, AttentionMetadata, torch.Tensor]  # token ids [T], metadata, logits rows [R]
# a plan's arrays and the op library's `step_inputs` outputs for them -> the eager inputs (None: not the paged path)
EagerFromOp = Callable[[PlanRows, Sequence[torch.Tensor]], "EagerInputs | None"]


@dataclass(frozen=True)
class StepInputs:
    """One launch's inputs: a CUDA graph's (`graph`) or the eager forward's (`eager`)."""

    graph: GraphInputs | None = None
    eager: EagerInputs | None = None


class LaunchInputs:
    """A runner's launch inputs, read (and, with `build_ahead`, built) ahead of the launch by `prepare`."""

    def __init__(self, block_size: int, device: torch.device, graphs: Callable[[], GraphedSteps | None],
                 eager: Callable[[StepPlan, PlanRows], EagerInputs], build_ahead: Callable[[], bool],
                 eager_from_op: EagerFromOp | None = None) -> None:
        """graphs: the graphed steps in use now (None: eager only); eager: `step_inputs` of a plan and its arrays;
        build_ahead: whether `prepare` may build now too (not where the forward runs on the host's cores: that work
        would slow it, and be thrown away for a plan reshaped since; not while the forward in flight captures a CUDA
        graph: another thread's CUDA calls would break the capture); eager_from_op: the eager inputs from the op
        library's `step_inputs` outputs, where the runner's eager steps take the paged path now (None: never)."""
        self.device = device
        self._graphs, self._eager, self._build_ahead, self._eager_from_op = graphs, eager, build_ahead, eager_from_op
        # a step's paged inputs, and a plan's arrays patched, in one call each of the op library (csrc/plan_ops.cpp)
        patch = self._patched if load_cpu_kernels() and hasattr(torch.ops.tandem, "plan_patch_step") else None
        self.ahead: InputsAhead[StepInputs] = InputsAhead(block_size, self.build, self._with_ids, patch)
        self._read_tensors: tuple[PlanRows, ReadTensors] | None = None  # the read ahead's arrays as the patch takes them

    def prepare(self, plan: StepPlan) -> None:
        """Read (and, where `build_ahead()` allows, build) `plan`'s inputs now, while the forward before it runs;
        with a patch, the read's arrays are wrapped as tensors for it now too (off the launch's path)."""
        self.ahead.prepare(plan, build=self._build_ahead())
        read = self.ahead.read
        self._read_tensors = (read, read_tensors(read)) if read is not None and self.ahead.patches else None

    def __call__(self, plan: StepPlan) -> tuple[PlanRows, StepInputs]:
        """The launch's inputs, and the plan's arrays they were built from."""
        rows, built = self.ahead.take(plan)
        if built is None or (built.graph is not None and self._graphs() is None):  # (graphs paused since)
            built = self.build(plan, rows)
        return rows, built

    def captures(self, inputs: StepInputs) -> bool:
        """Whether launching `inputs` captures a new CUDA graph first."""
        graphs = self._graphs()
        return inputs.graph is not None and graphs is not None and inputs.graph.key not in graphs.steps

    def build(self, plan: StepPlan, rows: PlanRows) -> StepInputs:
        graphs = self._graphs()
        padded = graphs.prepare(plan, rows) if graphs is not None else None
        return StepInputs(graph=padded) if padded is not None else StepInputs(eager=self._eager(plan, rows))

    def _patched(self, read: PlanRows, edits: list[int]) -> tuple[PlanRows, StepInputs | None]:
        """A reshaped plan's arrays from its read and its edits (`InputsAhead`'s patch), and its inputs: one call
        of the op library (`plan_patch_step`) gives both the eager paged step's inputs and the plan's graph shape; a
        graph's step is padded from that shape."""
        held = self._read_tensors[1] if self._read_tensors is not None and self._read_tensors[0] is read else None
        if self._eager_from_op is None:
            return patched_rows(read, edits, held), None
        rows, step, q = patched_step(read, edits, held)
        graphs = self._graphs()
        padded = graphs.pad(rows, q) if graphs is not None else None
        if padded is not None:
            return rows, StepInputs(graph=padded)
        eager = self._eager_from_op(rows, step)
        return rows, (StepInputs(eager=eager) if eager is not None else None)

    def _with_ids(self, built: StepInputs, rows: PlanRows) -> StepInputs:
        """`built` with the input ids of `rows` (the rest as built: only fed tokens changed)."""
        graphs = self._graphs()
        if built.graph is not None:  # (without graphs now, the launch builds its inputs again)
            return StepInputs(graph=graphs.with_ids(built.graph, rows.input_ids)) if graphs is not None else built
        assert built.eager is not None
        _, meta, wanted = built.eager
        return StepInputs(eager=(host_ids(rows.input_ids, self.device), meta, wanted))


def patched_rows(read: PlanRows, edits: list[int], held: ReadTensors | None = None) -> PlanRows:
    """The arrays of a plan from its read ahead and its edits since (`_Read.edits_flat`), in one call of the op
    library (csrc/plan_ops.cpp: `plan_patch`) instead of reading its rows again (`held`: `read_tensors(read)`, when
    taken ahead)."""
    return _rows_of(read, torch.ops.tandem.plan_patch(*(held or read_tensors(read)), _edits(edits)))


def patched_step(read: PlanRows, edits: list[int],
                 held: ReadTensors | None = None) -> tuple[PlanRows, list[torch.Tensor], int]:
    """`patched_rows`, the op library's `step_inputs` outputs for the patched rows, and the CUDA graph's q of the
    patched plan (0: no graph's shape), in one call (csrc/plan_ops.cpp: `plan_patch_step`)."""
    out, q = torch.ops.tandem.plan_patch_step(*(held or read_tensors(read)), _edits(edits), read.block_size,
                                              DECODE_MAX_QUERY)
    return _rows_of(read, out[:6]), out[6:], q


ReadTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def read_tensors(read: PlanRows) -> ReadTensors:
    """A read's six arrays as the op library's patch calls take them (shared memory). Taken ahead, beside the
    forward: at the launch, after the host's sampling has flushed the caches, the six wraps took ~0.05 ms (AMD EPYC
    Zen 4, 2026-12-06)."""
    t = torch.from_numpy
    return t(read.starts), t(read.counts), t(read.wanted), t(read.used), t(read.input_ids), t(read.blocks)


def _edits(edits: list[int]) -> torch.Tensor:
    """[E] int64: the edits as the op takes them."""
    return torch.from_numpy(np.array(edits, dtype=np.int64))


def _rows_of(read: PlanRows, out: list[torch.Tensor]) -> PlanRows:
    """The patched plan's arrays from the op's first six outputs (the read's block size and request ids)."""
    starts, counts, wanted, used, ids, blocks = (x.numpy() for x in out)
    return PlanRows(read.block_size, starts, counts, wanted, used, ids, blocks, read.request_ids)
