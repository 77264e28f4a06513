"""The model-runner seam: what the engine asks of the device side. `ModelRunner` runs a real model on one device;
`SimulatedRunner` stands in for an accelerator when sizing the CPU side (benchmarks only)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.core.plan import StepPlan
from tandem.runner.tensor_thread import tensor_thread

T = TypeVar("T")


@dataclass
class ForwardHandle:
    """A launched forward; `collect` turns it into logits."""

    future: Future[tuple[torch.Tensor, float]]
    finished_at: float = 0.0  # perf_counter() when the forward finished (set by collect)


class Runner(ABC):
    """Launches one step's forward and hands back its logits; owns the KV cache's memory."""

    device: torch.device
    num_blocks: int  # KV cache blocks the scheduler may hand out
    kv_cache_bytes: int
    kv_block_bytes: int = 0  # one block over every layer (this rank's shard of it under tensor parallelism)

    @property
    def forward_uses_host_cores(self) -> bool:
        """The forward runs on the host's CPU cores (a CPU device): host work beside it competes for them."""
        return self.device.type == "cpu"

    @property
    def launches_unsettled(self) -> bool:
        """Scheduling ahead with drafts: `launch` takes a plan whose rows still lack the outcome of the plan before
        it, given as `plan.edits.outcome` (put into the plan's read ahead; the rows learn it after the launch), and
        reads nothing else of the plan's rows."""
        return False

    def prepare(self, plan: StepPlan) -> None:  # noqa: B027 - a runner that reads nothing ahead ignores it
        """Scheduling ahead: `plan` was just scheduled and will be launched next, after the plan in flight ends (its
        rows may still be fed, moved back or drop out): read what of it can be read now (its block tables)."""

    @abstractmethod
    def launch(self, plan: StepPlan) -> ForwardHandle:
        """Start the forward of `plan` and return at once; the CPU is free until `collect`."""

    def collect(self, handle: ForwardHandle) -> torch.Tensor:
        """Wait for the forward; logits [R, V] float32 on the device, R = plan.num_logits_rows, in plan order. The
        tensor is the caller's: no later forward writes it (the engine checks rows of it during the next forward)."""
        logits, handle.finished_at = handle.future.result()
        return logits

    def on_tensor_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the process's tensor thread and wait (host-side tensor work such as sampling belongs
        there, see runner/tensor_thread.py)."""
        return tensor_thread().run(fn, *args)

    def set_num_threads(self, n: int) -> None:  # noqa: B027 - only a CPU forward has threads to lend
        """Threads of the forward on the CPU from the next step on."""

    def stats_dict(self) -> dict[str, float]:
        """The runner's own counters for `LLMEngine.get_stats` (a tensor-parallel group's bytes per collective)."""
        return {}

    def kv_cache_resident_bytes(self, touched_blocks: int) -> int:  # noqa: ARG002 - a host cache's reading uses it
        """Bytes of the KV cache in memory now (`touched_blocks`: the blocks ever used so far): all of it where it is
        allocated up front (an accelerator's)."""
        return self.kv_cache_bytes

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.collect(self.launch(plan))

    def shutdown(self) -> None:  # noqa: B027 - the tensor thread is the process's and outlives a runner
        """Release what the runner holds."""


def done_at_now(logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A forward's result: logits and the time it finished."""
    return logits, time.perf_counter()
