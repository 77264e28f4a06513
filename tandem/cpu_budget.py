"""One CPU budget: which cores and how many threads the forward, the grammar pool and the draft worker get.

Defaults come from the cores this process may use (`os.sched_getaffinity`); `$TANDEM_NUM_THREADS` caps the forward's
threads when no count is given (the test suite sets 1: on a loaded machine every OpenMP region of a 2-thread team
waits for a descheduled thread, which made tiny-model steps 100x slower). With a draft model on the CPU the draft
worker gets its own core set (a quarter of the cores, at least one) and the forward keeps the rest; grammar mask
threads are few (mask fills take microseconds per row) and share the forward's cores. On a 2-core machine nothing can
be exclusive: the split then says so and everyone shares. Experts on the host beside an accelerator
(`cpu_offload_experts`) make the forward a host computation too: it gets the forward's cores, as on a CPU device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class CpuBudget:
    cores: tuple[int, ...]  # all cores this process may use
    forward_cores: tuple[int, ...]
    forward_threads: int  # torch intra-op threads of the forward (CPU device, host experts) / host side (accelerator)
    grammar_threads: int
    draft_cores: tuple[int, ...]  # empty: no draft worker
    draft_threads: int

    def describe(self) -> str:
        draft = f"draft worker cores {list(self.draft_cores)} x{self.draft_threads} threads" if self.draft_cores else "no draft worker"
        return (f"CPU budget: {len(self.cores)} cores; forward cores {list(self.forward_cores)} x{self.forward_threads} "
                f"threads; grammar {self.grammar_threads} threads; {draft}")

    def as_dict(self) -> dict[str, object]:
        return {"cpu_cores": len(self.cores), "forward_threads": self.forward_threads, "grammar_threads": self.grammar_threads,
                "draft_cores": list(self.draft_cores), "draft_threads": self.draft_threads}


def plan_cpu_budget(
    *,
    device: str = "cpu",
    draft_on_cpu: bool = False,
    forward_threads: int | None = None,
    grammar_threads: int | None = None,
    draft_threads: int | None = None,
    draft_cores: tuple[int, ...] | None = None,
    cores: tuple[int, ...] | None = None,
    host_experts: bool = False,
) -> CpuBudget:
    """Split the cores; explicit arguments win over the defaults. `host_experts`: some layers' experts run on the
    host's cores inside the forward (the forward then takes every core of its set, as on a CPU device)."""
    all_cores = tuple(sorted(cores if cores is not None else os.sched_getaffinity(0)))
    n = len(all_cores)
    if draft_on_cpu:
        if draft_cores is None:
            # exclusive cores only when there are enough to split; below 4 the worker shares them all (1 thread)
            draft_cores = all_cores[n - max(1, n // 4) :] if n >= 4 else all_cores
        rest = tuple(c for c in all_cores if c not in draft_cores) or all_cores
        if draft_threads is None and n < 4:
            draft_threads = 1
    else:
        draft_cores, rest = (), all_cores
    default_threads = len(rest) if device == "cpu" or host_experts else max(1, min(4, len(rest)))
    budget = CpuBudget(
        cores=all_cores,
        forward_cores=rest,
        forward_threads=forward_threads or min(default_threads, _env_threads() or default_threads),
        grammar_threads=grammar_threads or max(1, min(4, n // 4)),
        draft_cores=tuple(draft_cores),
        draft_threads=draft_threads or max(1, len(draft_cores)),
    )
    logger.info(budget.describe())
    return budget


def _env_threads() -> int | None:
    """$TANDEM_NUM_THREADS as a positive int, None when unset or not one."""
    value = os.environ.get("TANDEM_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def pin_current_thread_pool(cores: tuple[int, ...]) -> None:
    """Restrict this process to `cores` (the forward's set when a draft worker has its own)."""
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cores))
        except OSError as e:  # containers may forbid it: keep running unpinned
            logger.warning("could not pin to cores %s: %s", list(cores), e)
