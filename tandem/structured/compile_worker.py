"""Grammar compiles in worker processes that can be stopped: the CPU time a compile may use is bounded.

A thread cannot be killed, so a compile that explodes (an exponential regex, a deep schema) would hold a core for
minutes. Here each compile runs in a spawned worker process; the calling thread waits on the pipe and reads the
worker's CPU time from /proc. Past `cpu_limit_s` of the job's own CPU time (time queued or preempted does not
count) the worker is killed and the call raises GrammarError; a fresh worker is started for the next job. A worker
that crashes (a native fault in the grammar library) fails only its job. Workers die with their parent
(PR_SET_PDEATHSIG), also when the parent is killed.

Protocol over a duplex pipe: worker -> parent ("ready",) once; parent -> worker a job; worker -> parent
("ok", payload) | ("error", reason). Jobs and payloads are plain data.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tandem.structured.backend import GrammarError

_POLL_S = 0.02  # how often a waiting call checks the worker's CPU time
_START_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1

Handler = Callable[[Any], Any]  # job -> payload (raises GrammarError for a rejected spec)


def serve(conn: Connection, make_handler: Callable[[Any], Handler], init: Any, memory_limit_bytes: int = 0) -> None:
    """A worker's main loop: build the handler from `init`, say ready, answer jobs until the pipe closes.

    With `memory_limit_bytes` the worker's address space is capped: a compile that allocates without bound
    fails with an error (std::bad_alloc) instead of waking the OOM killer, who might pick another process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    handler = make_handler(init)
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", handler(job)))
        except GrammarError as e:
            conn.send(("error", e.reason))
        except Exception as e:  # a library bug on one input: this job fails, the worker lives on
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (0.0 when /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class _Worker:
    """One worker: `python -m tandem.structured.compile_worker MODULE FUNCTION FD` over a socket pair.

    Started as a plain subprocess rather than with multiprocessing, so a user's script is never re-imported in
    the worker (no `if __name__ == "__main__":` guard needed).
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", __name__, target.__module__, target.__qualname__, str(theirs.fileno())]
        self.process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(args)
        if not self.conn.poll(_START_TIMEOUT_S) or self._recv_ready() is None:
            self.kill()
            raise GrammarError(name, "the compile worker did not start")

    def _recv_ready(self) -> tuple[Any, ...] | None:
        with contextlib.suppress(EOFError, OSError):
            msg: tuple[Any, ...] = self.conn.recv()
            return msg if msg[0] == "ready" else None
        return None

    def alive(self) -> bool:
        return self.process.poll() is None

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
        self.conn.close()


class CompileWorkerPool:
    """Up to `size` worker processes, started on first use; `run(job)` blocks the calling thread only."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], size: int, cpu_limit_s: float, name: str) -> None:
        """`target(conn, *args)` is the worker's main (usually `serve` wrapped by the backend)."""
        self.cpu_limit_s = cpu_limit_s
        self.name = name
        self._target = target
        self._args = args
        self._size = size
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()
        self._closed = False
        self.kills = 0  # workers killed for exceeding the CPU limit
        self.crashes = 0

    def run(self, job: Any) -> Any:
        """The worker's payload for `job`. Raises GrammarError: rejected, over the CPU limit, or the worker crashed."""
        worker = self._acquire()
        try:
            worker.conn.send(job)
            msg = self._wait(worker)
        except BaseException:
            worker.kill()
            self._forget()
            raise
        self._idle.put(worker)
        if msg[0] == "error":
            raise GrammarError(self.name, msg[1])
        return msg[1]

    def _wait(self, worker: _Worker) -> tuple[Any, ...]:
        start = worker.cpu_seconds()
        while not worker.conn.poll(_POLL_S):
            if not worker.alive():
                self.crashes += 1
                raise GrammarError(self.name, f"the compile worker crashed (exit code {worker.process.returncode})")
            used = worker.cpu_seconds() - start
            if used > self.cpu_limit_s:
                self.kills += 1
                raise GrammarError(self.name, f"compilation used more than {self.cpu_limit_s:g} s of CPU time; stopped")
        try:
            msg: tuple[Any, ...] = worker.conn.recv()
        except (EOFError, OSError) as e:
            self.crashes += 1
            raise GrammarError(self.name, f"the compile worker crashed: {e}") from e
        return msg

    def _acquire(self) -> _Worker:
        """An idle worker, a new one while fewer than `size` exist, else wait for one to come back."""
        while True:
            with self._lock:
                if self._closed:
                    raise GrammarError(self.name, "the compile workers are shut down")
                with contextlib.suppress(queue.Empty):
                    return self._idle.get_nowait()
                start_one = self._started < self._size
                if start_one:
                    self._started += 1
            if start_one:
                try:
                    return _Worker(self._target, self._args, f"tandem-{self.name}-compile")
                except BaseException:
                    self._forget()
                    raise
            with contextlib.suppress(queue.Empty):
                return self._idle.get(timeout=0.05)  # a killed worker frees a slot: look again

    def _forget(self) -> None:
        with self._lock:
            self._started -= 1

    def shutdown(self) -> None:
        """Stop the idle workers; a job still running ends when its worker is killed by the caller's wait."""
        with self._lock:
            self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


def _main(argv: list[str]) -> None:
    """Worker entry point: MODULE FUNCTION FD; the first message on FD is the function's extra arguments."""
    module, function, fd = argv
    conn = Connection(int(fd))
    args = conn.recv()
    getattr(importlib.import_module(module), function)(conn, *args)


if __name__ == "__main__":
    _main(sys.argv[1:])
