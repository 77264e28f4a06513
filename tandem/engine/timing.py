"""Where a step's wall time goes: `StepTimer` marks the phases of one step, `EngineStats` sums them."""

from __future__ import annotations

import time
from dataclasses import dataclass


class StepTimer:
    """perf_counter() marks of one step's phases, in the order of `LLMEngine.step`."""

    def __init__(self) -> None:
        self._marks = {"start": time.perf_counter()}

    def mark(self, phase: str) -> None:
        self._marks[phase] = time.perf_counter()

    def at(self, phase: str) -> float:
        return self._marks[phase]

    def span(self, first: str, last: str) -> float:
        """Seconds from mark `first` to mark `last`."""
        return self._marks[last] - self._marks[first]


@dataclass
class EngineStats:
    """Cumulative counters and phase times of the engine's steps."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    forward_s: float = 0.0  # from the end of drafting until the logits were collected
    cpu_overlap_s: float = 0.0  # CPU work done while the forward ran (grammar masks, look-ahead drafting)
    draft_s: float = 0.0  # drafting before the step (the device waits for it)
    sample_s: float = 0.0
    launch_gap_s: float = 0.0  # scheduling ahead: host time between sampling and the next launch (device idle)
    num_late_rows: int = 0  # scheduling ahead: rows sampled again during the next forward, which their request sat out
    num_retracted_rows: int = 0  # scheduling ahead: unmasked argmaxes rejected after the next launch; that row thrown away
    num_rewritten_rows: int = 0  # and drafts verified unmasked whose tokens were rejected after it: the same
    # their sampling: device work that overlaps the next forward (a benchmark must not count it as the device's time
    # on the critical path, as it does sample_s)
    late_sample_s: float = 0.0
    steps_scheduled_ahead: int = 0  # steps whose plan was scheduled while the previous forward ran
    steps_ahead_with_drafts: int = 0  # ... that verified drafts
    steps_launched_before_settle: int = 0  # ... whose next plan was launched before its rows learned their outcome
    num_ended_rows_withdrawn: int = 0  # ... rows of requests their step's tokens ended, left out of the next plan
    # from one forward's end (as the runner reports it) to the next launch: the device had nothing to do
    device_idle_s: float = 0.0

    def record(self, timer: StepTimer, num_preempted: int) -> None:
        """Add one step whose timer marked 'drafted', 'launched', 'overlapped', 'collected' and 'sampled'."""
        self.num_steps += 1
        self.num_preemptions += num_preempted
        self.draft_s += timer.span("start", "drafted")
        self.forward_s += timer.span("drafted", "collected")
        self.cpu_overlap_s += timer.span("launched", "overlapped")
        self.sample_s += timer.span("collected", "sampled")

    def record_ahead(self, timer: StepTimer, num_preempted: int) -> None:
        """Add one step scheduled ahead, whose timer marked 'scheduled', 'collected', 'sampled', 'launched' and
        'overlapped' (the next plan was scheduled, and this one advanced, while a forward ran)."""
        self.num_steps += 1
        self.steps_scheduled_ahead += 1
        self.num_preemptions += num_preempted
        self.forward_s += timer.span("scheduled", "collected")
        self.cpu_overlap_s += timer.span("start", "scheduled") + timer.span("launched", "overlapped")
        self.sample_s += timer.span("collected", "sampled")
        self.launch_gap_s += timer.span("sampled", "launched")
