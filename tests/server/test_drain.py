"""SIGTERM drains `tandem serve`: while a request is in flight, /health and new requests answer 503 "draining" (a load
balancer takes the instance out), the request runs to its normal end, then the server exits. Past
--shutdown-grace-period, what is still in flight is failed with an error event and the server exits as well.

Two levels:
  * in-process: the real app and GracefulServer (uvicorn on a loopback port, in a thread) over an engine client whose
    deltas the test hands out, so a request is in flight exactly as long as the test wants;
  * the real `tandem serve` process on stories260K and a real SIGTERM. Its stream in flight is held by the client: it
    reads one event, then stops reading while the drain is probed. The output (32 x 470 tokens with logprobs, over
    10 MB of events) is far larger than the socket buffers (4 MiB at most here; the client's receive buffer is set to
    4 KiB), so the server cannot finish writing it before the client reads on.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn

from tandem.bench.serve import free_port, launch_server
from tandem.server.api import GracefulServer, ServerConfig, create_app
from tandem.server.engine_client import CompletionDelta, EngineClient, ModelInfo, RequestDelta

STORIES = Path(__file__).resolve().parents[2] / "../shared/data/models/stories260K/stories260K.bin"

needs_stories = pytest.mark.skipif(not STORIES.is_file(), reason="shared/data stories260K not present")

N, MAX_TOKENS = 32, 470


# ------------------------------------------------------------------------------------------------ in-process
class ScriptedClient(EngineClient):
    """The real EngineClient's request bookkeeping without an engine-core process: the test hands out deltas."""

    async def start(self, timeout_s: float = 900.0) -> ModelInfo:
        self.info = ModelInfo(max_model_len=64, vocab_size=100, has_chat_template=False, core_pid=0)
        return self.info

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.accepting = False
        self.abort_all("the server is shutting down")

    def emit(self, loop: asyncio.AbstractEventLoop, text: str, finish: str | None = None) -> None:
        """Give every request in flight one more delta (from the test's thread)."""
        def put() -> None:
            for rid, stream in list(self._streams.items()):
                if finish is not None:
                    self._streams.pop(rid)
                stream._put(RequestDelta(rid, 3, 0, finish is not None, None,
                                         [CompletionDelta(0, text, [7], None, finish, None)]))
        loop.call_soon_threadsafe(put)


class InProcessServer:
    def __init__(self, grace_s: float) -> None:
        self.client = ScriptedClient(None)
        self.app = create_app(self.client, ServerConfig(served_model_names=["m"], shutdown_grace_period_s=grace_s))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = GracefulServer(config, self.app.state.tandem)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died while starting"
            self.thread.join(0.02)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self.app.state.tandem.loop
        assert loop is not None
        return loop

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # what the signal handler runs

    def stream(self) -> tuple[httpx.Client, Any, Iterator[str]]:
        """A streaming completion; returns once its first event (the first delta) has arrived."""
        http_client = httpx.Client(timeout=60)
        cm = http_client.stream("POST", f"{self.url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        opened: list[Any] = []
        opener = threading.Thread(target=lambda: opened.append(cm.__enter__()))  # returns with the response headers,
        opener.start()  # which the server sends after the first delta
        while self.client.num_in_flight == 0:  # the request reached the engine client
            assert opener.is_alive(), "the request ended before reaching the engine client"
            opener.join(0.01)
        self.client.emit(self.loop, "a")
        opener.join(60)
        resp = opened[0]
        assert resp.status_code == 200
        lines = (line for line in resp.iter_lines() if line)
        assert '"text":"a"' in next(lines)
        return http_client, cm, lines


def _in_flight(srv: InProcessServer) -> int:
    return srv.app.state.tandem.admitted_seqs  # type: ignore[no-any-return]


def test_drain_refuses_new_work_and_lets_the_stream_finish() -> None:
    srv = InProcessServer(grace_s=300.0)
    http_client, cm, lines = srv.stream()
    srv.sigterm()
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
    new = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 2})
    assert new.status_code == 503 and new.json()["error"]["code"] == "draining"
    assert _in_flight(srv) == 1 and srv.thread.is_alive()
    srv.client.emit(srv.loop, "b")  # the request goes on producing while the server drains
    assert '"text":"b"' in next(lines)
    srv.client.emit(srv.loop, "c", finish="length")
    rest = list(lines)
    assert '"text":"c"' in rest[0] and '"finish_reason":"length"' in rest[0] and rest[-1] == "data: [DONE]"
    cm.__exit__(None, None, None)
    http_client.close()
    srv.thread.join(60)  # drained: the server shuts down by itself, long before the grace period
    assert not srv.thread.is_alive() and srv.app.state.tandem.shutting_down


def test_past_the_grace_period_the_stream_gets_an_error_event() -> None:
    srv = InProcessServer(grace_s=0.3)
    http_client, cm, lines = srv.stream()
    srv.sigterm()
    rest = list(lines)  # no more deltas come: the grace period ends it
    assert rest[-1] == "data: [DONE]"
    assert "the server is shutting down" in json.loads(rest[-2][6:])["error"]["message"], rest
    cm.__exit__(None, None, None)
    http_client.close()
    srv.thread.join(60)
    assert not srv.thread.is_alive() and _in_flight(srv) == 0


@pytest.mark.parametrize("how", ["second-signal", "no-grace-period"])
def test_second_signal_or_zero_grace_fails_at_once(how: str) -> None:
    srv = InProcessServer(grace_s=300.0 if how == "second-signal" else 0.0)
    http_client, cm, lines = srv.stream()
    srv.sigterm()
    if how == "second-signal":
        assert httpx.get(f"{srv.url}/health").json()["error"]["code"] == "draining"
        srv.sigterm()
    rest = list(lines)
    assert "the server is shutting down" in rest[-2] and rest[-1] == "data: [DONE]"
    cm.__exit__(None, None, None)
    http_client.close()
    srv.thread.join(60)
    assert not srv.thread.is_alive()


# ------------------------------------------------------------------------------ the real process and signal


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path, int]]:
    """Starts a server with the grace period the test names (indirect parameter); kills it if it is still up."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(grace_s: float) -> tuple[str, subprocess.Popen[bytes], Path, int]:
        log_path = tmp_path / "server.log"
        port = free_port()
        args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32", "--num-kv-blocks", "1100",
                "--shutdown-grace-period", str(grace_s), "--log-level", "info"]
        with open(log_path, "wb") as log:
            try:
                proc = launch_server(str(STORIES), args, port, startup_timeout_s=300, log=log)
            except RuntimeError as e:
                pytest.fail(f"{e}\n{log_path.read_text()[-3000:]}")
        procs.append(proc)
        return f"http://127.0.0.1:{port}", proc, log_path, port

    yield start  # type: ignore[misc]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_until_engine_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the engine reports no sequence running or waiting (its last step's stats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        if "tandem_num_requests_running 0.0" in metrics and "tandem_num_requests_waiting 0.0" in metrics:
            return
        time.sleep(0.2)
    raise AssertionError("the engine did not finish the held stream's sequences")


class HeldStream:
    """A streaming completion read one event at a time over a socket with a 4 KiB receive buffer."""

    def __init__(self, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: no autotuning
        sock.settimeout(120)
        sock.connect(("127.0.0.1", port))
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.conn.sock = sock
        body = {"prompt": "Once", "max_tokens": MAX_TOKENS, "n": N, "ignore_eos": True, "stream": True, "logprobs": 5}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

    def next_event(self) -> str:
        while True:
            line = self.resp.readline().decode().strip()
            if line:
                return line
            if self.resp.isclosed():
                raise EOFError

    def rest(self) -> list[str]:
        return [line for line in self.resp.read().decode().splitlines() if line]


def _finish_reasons(events: list[str]) -> list[str]:
    reasons = []
    for e in events:
        if e.startswith("data: {"):
            for c in json.loads(e[6:]).get("choices", []):
                if c.get("finish_reason"):
                    reasons.append(c["finish_reason"])
    return reasons


@pytest.mark.slow
@needs_stories
def test_sigterm_drains_streams_in_flight(serve) -> None:  # type: ignore[no-untyped-def]
    url, proc, log, port = serve(120.0)
    stream = HeldStream(port)
    first = stream.next_event()
    assert first.startswith("data: {")
    proc.send_signal(signal.SIGTERM)
    # draining: still listening, out of the load balancer's pool, refusing new work
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["code"] == "draining", health.text
    new = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
    assert new.status_code == 503 and new.json()["error"]["code"] == "draining", new.text
    assert proc.poll() is None  # the stream in flight holds the drain open
    events = [first, *stream.rest()]
    assert events[-1] == "data: [DONE]"
    assert _finish_reasons(events) == ["length"] * N  # every sequence ran to its end, none was failed
    assert not any('"error"' in e for e in events)
    # uvicorn re-raises the captured SIGTERM after its orderly shutdown, so -SIGTERM is a clean exit too
    assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
@needs_stories
def test_sigterm_with_a_stuck_client_still_exits(serve) -> None:  # type: ignore[no-untyped-def]
    """A client that never reads on cannot keep the server up: its stream is stuck writing (the engine has finished
    every sequence; the events wait on the socket), so it outlives the grace period; the server cuts the connection
    just before uvicorn's own shutdown timeout and exits cleanly, with a warning and no traceback."""
    url, proc, log, port = serve(1.0)
    stream = HeldStream(port)
    stream.next_event()
    _wait_until_engine_idle(url)  # the stream's 10 MB of events cannot all fit the socket buffers: it is stuck now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and "cutting 1 connection(s)" in text, text[-3000:]
    try:
        events = stream.rest()
    except http.client.IncompleteRead as e:  # cut mid-event by the closing server
        events = [line for line in e.partial.decode().splitlines() if line]
    assert len(_finish_reasons(events)) < N  # the stream did not run to its end
