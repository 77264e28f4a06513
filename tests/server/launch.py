"""One `tandem serve` process for a test module: started on a free port, its log kept, stopped with SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tandem.bench.serve import free_port, launch_server


@contextmanager
def running_server(
    log_path: Path, model: str | None, args: Sequence[str], env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 420, require_clean_exit: bool = False,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Yield (process, base URL) of a server started with `args`; its output goes to `log_path` (shown when it fails
    to start). On exit: SIGTERM, 30 s to stop, then SIGKILL (a test failure with `require_clean_exit`)."""
    port = free_port()
    with open(log_path, "wb") as log:
        try:
            proc = launch_server(model, list(args), port, startup_timeout_s=startup_timeout_s, log=log,
                                 env=dict(env) if env is not None else None)
        except RuntimeError as e:
            pytest.fail(f"{e}\n{log_path.read_text()[-3000:]}")
        yield proc, f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            if require_clean_exit:
                pytest.fail("the server did not exit within 30 s of SIGTERM")
