"""When the device works and when it waits: marks at the start and the end of each forward, read after the run.

On CUDA the marks are events recorded on the runner's stream, timed by the device itself, so the gap between one
forward's end and the next one's start is time the device had nothing queued: it waited for the host (scheduling,
grammar masks, drafting, sampling's host side). The gap also holds the sampler's kernels, which run between
forwards, so it is an upper bound of the host's share. On the host the marks are `perf_counter` readings (the dry
run of the device check).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DeviceTimeline:
    """Marks of the forwards since `clear`; `record_start` / `record_end` are called where the forward is queued."""

    device: torch.device
    marks: list[tuple[Any, Any]] = field(default_factory=list)  # (start, end) per forward: events or seconds
    _start: Any = None

    def _mark(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def record_start(self) -> None:
        self._start = self._mark()

    def record_end(self) -> None:
        self.marks.append((self._start, self._mark()))

    def clear(self) -> None:
        self.marks.clear()

    def _seconds(self, a: Any, b: Any) -> float:
        if self.device.type == "cuda":
            return float(a.elapsed_time(b)) / 1e3  # events: milliseconds
        return float(b - a)

    def summary(self) -> dict[str, float]:
        """busy_s (inside forwards), idle_s (between one forward's end and the next one's start), idle_fraction,
        idle_per_step_ms; the device is synchronized first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        busy = sum(self._seconds(s, e) for s, e in self.marks)
        idle = sum(max(0.0, self._seconds(e0, s1)) for (_, e0), (s1, _) in zip(self.marks, self.marks[1:]))
        steps = max(1, len(self.marks) - 1)
        total = busy + idle
        return {
            "forwards": len(self.marks), "busy_s": round(busy, 4), "idle_s": round(idle, 4),
            "idle_fraction": round(idle / total, 4) if total else 0.0, "idle_per_step_ms": round(idle / steps * 1e3, 3),
        }
