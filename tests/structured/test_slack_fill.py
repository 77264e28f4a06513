"""SlackFill (rows filled in the forward's slack): rows start only before the deadline, after the required fills,
and not after `stop()`; `join` waits for the rows in progress; the row clock learns the rows' time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tandem.structured.slack_fill import RowClock, SlackFill


@pytest.fixture
def pool() -> ThreadPoolExecutor:  # type: ignore[misc]
    p = ThreadPoolExecutor(2)
    yield p
    p.shutdown()


def test_every_row_is_filled_when_the_deadline_is_far(pool: ThreadPoolExecutor) -> None:
    fill = SlackFill(list(range(10)), lambda w: [w * 10], time.perf_counter() + 60.0, RowClock())
    fill.start(pool.submit, 2)
    assert sorted(fill.join()) == [w * 10 for w in range(10)]


def test_no_row_starts_past_the_deadline(pool: ThreadPoolExecutor) -> None:
    clock = RowClock(first_s=0.5)  # a row is expected to take 0.5 s: none fits in 0.1 s
    fill = SlackFill(list(range(10)), lambda w: [w], time.perf_counter() + 0.1, clock)
    fill.start(pool.submit, 2)
    assert fill.join() == []


def test_rows_start_after_the_required_fills(pool: ThreadPoolExecutor) -> None:
    required: Future[float] = Future()
    started = threading.Event()
    fill = SlackFill([1, 2], lambda w: (started.set(), [w])[1], time.perf_counter() + 60.0, RowClock(), [required])
    fill.start(pool.submit, 2)
    assert not started.wait(0.1)  # the step's batch is still filling
    required.set_result(0.01)
    assert sorted(fill.join()) == [1, 2]


def test_stop_lets_no_further_row_start_and_join_waits_for_those_filling(pool: ThreadPoolExecutor) -> None:
    """The forward has ended: rows in progress finish (join waits for them, their results count), no other starts."""
    in_row, release = threading.Event(), threading.Event()

    def slow(w: int) -> list[int]:
        in_row.set()
        release.wait(5.0)
        return [w]

    fill = SlackFill(list(range(10)), slow, time.perf_counter() + 60.0, RowClock())
    fill.start(pool.submit, 1)
    assert in_row.wait(5.0)
    fill.stop()
    release.set()
    assert fill.join() == [0]


def test_a_forward_future_done_already_stops_at_once(pool: ThreadPoolExecutor) -> None:
    done: Future[None] = Future()
    done.set_result(None)
    fill = SlackFill(list(range(4)), lambda w: [w], time.perf_counter() + 60.0, RowClock())
    done.add_done_callback(lambda _: fill.stop())  # as the manager wires a Slack's `ends_with`
    fill.start(pool.submit, 2)
    assert fill.join() == []


def test_the_row_clock_follows_the_rows() -> None:
    clock = RowClock(first_s=1.0)
    for _ in range(80):
        clock.record(0.002)
    assert clock.expected_s == pytest.approx(0.002, rel=0.01)
