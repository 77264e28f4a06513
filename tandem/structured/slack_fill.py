"""Masks filled in the forward's slack.

A greedy row in a state of free text may skip its mask: it is sampled unmasked and its token checked afterwards
(`engine/guidance.py`). That check runs between the forward's end and the next launch, where the device waits for
it (~14 us a row over o200k, in lexer states the row has not met before, plus a walk of top candidates when the
grammar rejects the argmax). Scheduling ahead, the host often has cores to spare while the forward runs: those
rows are filled anyway, one at a time, each only while it is expected to finish before the `deadline` the engine
gives (a share of the forward's expected time). A row filled so is sampled under its mask and needs no check; a
row not reached is sampled unmasked, as before. Outputs are the same either way (the masked argmax).

256 guided requests over o200k beside a simulated 20 ms forward (`tandem bench simulated`, 2 cores): ~18 of the
~28 rows a step that could skip their mask were filled in the slack, and the device's wait fell from 1.0-1.2 ms a
step to 0.54-0.61 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Generic, TypeVar

W = TypeVar("W")  # one row's work
R = TypeVar("R")  # one row's result

_FIRST_ROW_S = 1e-3  # expected wall time of a row before any was measured (free-text fills over o200k: 0.3-2 ms)
_ROW_EMA = 0.2  # weight of the newest row in the expected row time


class RowClock:
    """The expected wall time of one slack row: an exponential moving average over the rows filled so far (rows of
    free text cost much alike; shared by the steps, so each step's first row is judged by the last step's)."""

    def __init__(self, first_s: float = _FIRST_ROW_S) -> None:
        self._lock = threading.Lock()
        self._expected_s = first_s

    @property
    def expected_s(self) -> float:
        return self._expected_s

    def record(self, seconds: float) -> None:
        with self._lock:
            self._expected_s += _ROW_EMA * (seconds - self._expected_s)


class SlackFill(Generic[W, R]):
    """Fills `work` one row at a time on the threads that call `run`, each row only while `time.perf_counter()` plus
    the expected row time is at most `deadline` and `stop()` has not been called, and not before the futures in
    `after` (the step's required fills) are done. `join()` waits for the workers (they end by the deadline) and
    returns every result.

    `fill(w)` fills one row and returns its results; it must not raise (a row's failure is a result)."""

    def __init__(self, work: Sequence[W], fill: Callable[[W], list[R]], deadline: float, clock: RowClock,
                 after: Sequence[Future[float]] = ()) -> None:
        self._work = list(work)
        self._fill = fill
        self._deadline = deadline
        self._clock = clock
        self._after = list(after)
        self._lock = threading.Lock()
        self._next = 0
        self._stopped = False
        self._results: list[R] = []
        self._workers: list[Future[None]] = []

    def start(self, submit: Callable[[Callable[[], None]], Future[None]], threads: int) -> None:
        """Run `threads` workers through `submit` (a pool of their own: they hold their threads until the deadline)."""
        self._workers = [submit(self.run) for _ in range(max(1, min(threads, len(self._work))))]

    def run(self) -> None:
        """One worker: wait for the required fills, then fill rows while they fit before the deadline."""
        wait_all(self._after)
        while (w := self._take()) is not None:
            started = time.perf_counter()
            results = self._fill(w)
            self._clock.record(time.perf_counter() - started)
            with self._lock:
                self._results.extend(results)

    def _take(self) -> W | None:
        with self._lock:
            if self._stopped or self._next >= len(self._work):
                return None
            if time.perf_counter() + self._clock.expected_s > self._deadline:
                self._stopped = True  # (a later row would not fit either)
                return None
            self._next += 1
            return self._work[self._next - 1]

    def stop(self) -> None:
        """No further row starts (the forward has ended: the rows still filling are waited for by `join`)."""
        with self._lock:
            self._stopped = True

    def join(self) -> list[R]:
        """Wait for the workers; the results of every row filled."""
        wait_all(self._workers)
        for worker in self._workers:
            worker.result()  # (a worker's failure is a bug: `fill` reports rows' failures as results)
        with self._lock:
            return list(self._results)
