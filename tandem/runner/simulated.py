"""A runner that stands in for an accelerator, to size the CPU side at the batch sizes a GPU serves (benchmarks).

Its forward uses no CPU: `launch` returns at once and the step's logits are ready `step_s` seconds later (a timer
thread sleeps), as a device's kernels would be. The logits come from a cheap source: a fixed table of random rows
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

import torch

from tandem.core.plan import StepPlan
from tandem.runner.base import ForwardHandle, Runner


class SimulatedRunner(Runner):
    """A device whose forward takes `step_s` of wall time and no host CPU."""

    def __init__(self, vocab_size: int, num_blocks: int, step_s: float, table_rows: int = 512, seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.kv_cache_bytes = 0
        self.step_s = step_s
        self.vocab_size = vocab_size
        g = torch.Generator().manual_seed(seed)
        self._table = (torch.randn(table_rows, vocab_size, generator=g) * 3.0).to(torch.bfloat16)  # [K, V]
        self._lock = threading.Lock()
        self.num_forwards = 0

    @property
    def forward_uses_host_cores(self) -> bool:
        return False  # the simulated device sleeps

    def launch(self, plan: StepPlan) -> ForwardHandle:
        """The forward 'runs' from now for step_s; its logits rows are looked up when it completes."""
        last = [r.input_ids[len(r.input_ids) - r.num_logits_rows + j] for r in plan.requests for j in range(r.num_logits_rows)]
        future: Future[tuple[torch.Tensor, float]] = Future()
        ready_at = time.perf_counter() + self.step_s
        timer = threading.Timer(self.step_s, self._finish, args=(future, last, ready_at))
        timer.daemon = True
        timer.start()
        with self._lock:
            self.num_forwards += 1
        return ForwardHandle(future, plan.num_logits_rows)

    def _finish(self, future: Future[tuple[torch.Tensor, float]], last: list[int], ready_at: float) -> None:
        k, r = self._table.shape[0], len(last)
        if 2 * r <= k:  # a view: row i is table[start + i], start moved by the tokens just fed
            start = hash(tuple(last)) % (k - r)
            logits = self._table[start : start + r]  # [R, V] bf16
        else:
            logits = self._table.index_select(0, torch.tensor([t % k for t in last], dtype=torch.long))
        future.set_result((logits, max(ready_at, time.perf_counter())))
