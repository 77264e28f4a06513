"""A runner that stands in for an accelerator, to size the CPU side at the batch sizes a GPU serves (benchmarks).

Its forward uses no CPU: `launch` returns at once and the step's logits are ready `step_s` seconds later, as a
device's kernels would be: `collect` sleeps until then (releasing the GIL) and reports that instant as the finish.
No thread completes the forward, so a busy host (a GIL held elsewhere) cannot make the device look late: whatever
the device waits is the host's lateness in calling `collect`, or in launching. The logits come from a cheap source: a fixed table of random rows
[table_rows, V] (bf16), row `last input token % table_rows` for each logits row, so a sampled token depends on the
previous one and guided requests walk through their grammars the way a model would, with no model (a contiguous
slice of the table when the rows fit, so the "device" copies nothing on the host). Sampling still
runs on the host (on a real accelerator it runs on the device): benchmarks count it as device time.
Not for serving: nothing it produces means anything.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.core.plan import StepPlan
from tandem.runner.base import ForwardHandle, Runner

_SPIN_S = 0.0005  # the end of a wait for the forward is spun, as CUDA's default synchronisation does


class SimulatedRunner(Runner):
    """A device whose forward takes `step_s` of wall time and no host CPU."""

    def __init__(self, vocab_size: int, num_blocks: int, step_s: float, table_rows: int = 512, seed: int = 0,
                 rows_by_token: bool = False) -> None:
        """rows_by_token: each row is table[last token % table_rows], so a request's logits depend on its own
        tokens alone, whatever else is in the batch (a copy per step; for tests comparing two runs). Otherwise
        a contiguous slice of the table when the rows fit (no copy; for benchmarks)."""
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.kv_cache_bytes = 0
        self.step_s = step_s
        self.vocab_size = vocab_size
        g = torch.Generator().manual_seed(seed)
        self._table = (torch.randn(table_rows, vocab_size, generator=g) * 3.0).to(torch.bfloat16)  # [K, V]
        self._lock = threading.Lock()
        self.num_forwards = 0
        self.rows_by_token = rows_by_token

    @property
    def forward_uses_host_cores(self) -> bool:
        return False  # the simulated device sleeps

    def launch(self, plan: StepPlan) -> ForwardHandle:
        """The forward 'runs' from now for step_s; its logits rows are looked up when it is collected."""
        last = [r.input_ids[len(r.input_ids) - r.num_logits_rows + j] for r in plan.requests for j in range(r.num_logits_rows)]
        with self._lock:
            self.num_forwards += 1
        return _SimulatedHandle(Future(), plan.num_logits_rows, ready_at=time.perf_counter() + self.step_s, last=last)

    def collect(self, handle: ForwardHandle) -> torch.Tensor:
        """Sleep until the forward is done (at once if it is already), then its logits [R, V] bf16."""
        assert isinstance(handle, _SimulatedHandle), "a handle of another runner"
        if not handle.future.done():
            time.sleep(max(0.0, handle.ready_at - _SPIN_S - time.perf_counter()))
            while time.perf_counter() < handle.ready_at:  # sleep wakes ~0.2 ms late here; a device sync spins
                pass
            handle.future.set_result((self._logits(handle.last), handle.ready_at))
        return super().collect(handle)

    def _logits(self, last: list[int]) -> torch.Tensor:
        k, r = self._table.shape[0], len(last)
        if 2 * r <= k and not self.rows_by_token:  # a view: row i is table[start + i], start moved by the tokens just fed
            start = hash(tuple(last)) % (k - r)
            return self._table[start : start + r]  # [R, V] bf16
        return self._table.index_select(0, torch.tensor([t % k for t in last], dtype=torch.long))


@dataclass
class _SimulatedHandle(ForwardHandle):
    ready_at: float = 0.0  # perf_counter() when the simulated forward is done
    last: list[int] = field(default_factory=list)  # the input token of each logits row
