"""The one thread that runs tandem's host-side tensor work in a process.

torch's CPU kernels parallelise with OpenMP, and every thread that enters a parallel region gets its own team of
worker threads. With two teams in a process on a small machine, libgomp sees more threads than cores and stops
spinning between regions: each of the ~120 projections of a decode step then pays a futex wake-up, which made the
forward ~45% slower (16 ms -> 23 ms per step on the 2-core VM). So loading, the forward, sampling and verification
all run here, on one thread and one OpenMP team, while the engine's own thread does the Python-side work (scheduling,
grammar masks, drafting, detokenizing) in between.

`run(fn, ...)` executes on this thread and waits; `submit(fn, ...)` returns a future (the launched forward). Calls
made from this thread itself run inline, so nothing deadlocks when host work nests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TensorThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tensor")
        self._ident: int | None = None
        self._executor.submit(self._mark).result()

    def _mark(self) -> None:
        self._ident = threading.get_ident()

    def on_it(self) -> bool:
        return threading.get_ident() == self._ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self.on_it():
            fut: Future[T] = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)
            return fut
        return self._executor.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.on_it() else self._executor.submit(fn, *args).result()


_lock = threading.Lock()
_thread: TensorThread | None = None
_pid = -1


def tensor_thread() -> TensorThread:
    """This process's tensor thread (created on first use; a forked child gets its own)."""
    global _thread, _pid
    with _lock:
        if _thread is None or _pid != os.getpid():
            _thread, _pid = TensorThread(), os.getpid()
        return _thread


def on_tensor_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on the tensor thread and return its result (inline when already there)."""
    return tensor_thread().run(fn, *args)
