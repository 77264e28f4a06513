"""`tandem serve --data-parallel-size 2`: two engine cores behind one server. The router's choices without a server,
then a DP=2 demo-model server: plain and streaming requests, 16 concurrent streams spread over both cores, and one
core killed while the other keeps serving (it restarts on its own)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tandem import LLM
from tandem.bench.serve import free_port, launch_server
from tandem.params import SamplingParams
from tandem.server.data_parallel import (
    PREFIX_CHARS,
    DataParallelClient,
    ReplicaLoad,
    Router,
    prefix_key,
    replica_kwargs,
)
from tandem.server.engine_client import EngineDeadError, RequestDelta
from tests.server.launch import running_server
from tests.server.test_server import API_KEY, MODEL, Server, chat, demo
from tests.tiny import save_tiny, tiny_model


def _load(in_flight: int, kv: float = 0.0, available: bool = True) -> ReplicaLoad:
    return ReplicaLoad(in_flight, kv, available)


def test_router_picks_the_least_loaded_available_replica() -> None:
    r = Router()
    assert r.pick([_load(3), _load(1)], None) == 1
    assert r.pick([_load(1, kv=0.9), _load(3)], None) == 1  # a nearly full KV cache counts as load
    assert r.pick([_load(0, available=False), _load(5)], None) == 1  # a restarting replica gets nothing
    assert r.pick([_load(0, available=False)], None) is None


def test_router_keeps_a_shared_prefix_on_its_replica_while_that_pays() -> None:
    r = Router()
    assert r.pick([_load(0), _load(0)], "k") == 0
    assert r.pick([_load(2), _load(0)], "k") == 0  # busier, but within the slack: its prefix cache wins
    assert r.pick([_load(9), _load(0)], "k") == 1  # too busy: the prefix moves
    assert r.prefix_routed == 1


def test_prefix_key_only_for_prompts_long_enough_to_share() -> None:
    assert prefix_key({"prompt": "short"}) is None
    long = "x" * PREFIX_CHARS
    assert prefix_key({"prompt": long + "a"}) == prefix_key({"prompt": long + "b"}) is not None
    assert prefix_key({"prompt_token_ids": list(range(PREFIX_CHARS))}) is not None


def test_replicas_split_the_cores() -> None:
    cores = sorted(os.sched_getaffinity(0))
    kws = replica_kwargs({"device": "cpu", "memory_fraction": 0.6}, 2)
    assert [kw["kv_share"] for kw in kws] == [0.5, 0.5]  # the host's memory (and its default KV pool) is shared too
    if len(cores) >= 2:
        assert sorted(c for kw in kws for c in kw["cpu_cores"]) == cores
    assert [kw["device"] for kw in replica_kwargs({"device": "cuda", "tensor_parallel_size": 2}, 2)] == ["cuda:0", "cuda:2"]


class _FakeStream:
    def __init__(self, dies: bool) -> None:
        self.dies, self.aborted = dies, False

    async def next(self) -> RequestDelta:
        if self.dies:
            raise EngineDeadError("engine core process was killed by SIGKILL")
        return RequestDelta("r", 3, 0, True, None)

    def abort(self) -> None:
        self.aborted = True


class _FakeReplica:
    """What the router reads of an EngineClient, and an `add` whose stream dies (the core was killed) or answers."""

    def __init__(self, dies: bool) -> None:
        self.dies, self.alive, self.accepting, self.added = dies, True, True, 0
        self.stats: dict[str, float] = {}
        self.dead_reason: str | None = None

    @property
    def num_in_flight(self) -> int:
        return 0

    def add(self, request_id: str, prompt: object, params: SamplingParams) -> _FakeStream:
        self.added += 1
        if self.dies:
            self.alive, self.dead_reason = False, "killed"  # its sentinel fires after the request was sent
        return _FakeStream(self.dies)


def test_a_request_whose_core_dies_before_its_first_delta_goes_to_another() -> None:
    fakes = [_FakeReplica(dies=True), _FakeReplica(dies=False)]
    dp = DataParallelClient(None, {}, 2, make_client=lambda model, kw: fakes.pop(0))  # type: ignore[arg-type,return-value]
    stream = dp.add("r", {"prompt": "hi"}, SamplingParams())
    assert stream.replica == 0  # type: ignore[attr-defined]  # both idle: the first
    delta = asyncio.run(stream.next())
    assert delta.finished and stream.replica == 1 and dp.resubmitted == 1  # type: ignore[attr-defined]
    lone = DataParallelClient(None, {}, 1, make_client=lambda model, kw: _FakeReplica(dies=True))  # type: ignore[arg-type,return-value]
    with pytest.raises(EngineDeadError):  # nobody left to take it: the error reaches the API (503)
        asyncio.run(lone.add("r", {"prompt": "hi"}, SamplingParams()).next())


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve-dp") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--num-kv-blocks", "160",
            "--max-queue", "32", "--request-timeout", "120", "--log-level", "warning", "--data-parallel-size", "2"]
    env = {**os.environ, "TANDEM_API_KEY": API_KEY}
    with running_server(log_path, None, args, env, require_clean_exit=True) as (proc, url):
        yield Server(proc, url, log_path)


@demo
def test_dp2_plain_and_streaming(dp_server: Server) -> None:
    health = httpx.get(f"{dp_server.url}/health").json()
    assert len(set(health["engine_core_pids"])) == 2
    assert chat(dp_server, max_tokens=4, temperature=0).choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in chat(dp_server, max_tokens=6, stream=True) if c.choices)
    assert text


async def _streams(url: str, n: int, max_tokens: int) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300.0)

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say the number {i}."}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True})
        usage = 0
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()


@demo
def test_dp2_concurrent_streams_use_both_cores(dp_server: Server) -> None:
    before = dp_server.metrics()
    assert all(1 <= n <= 6 for n in asyncio.run(_streams(dp_server.url, 16, 6)))
    m = dp_server.metrics()
    assert m["tandem_engine_dp_replicas_alive"] == 2
    # both cores ran requests: each replica's cumulative stats are summed, so both moved
    assert m["tandem_prefix_cache_queries"] > before.get("tandem_prefix_cache_queries", 0.0)


@demo
def test_dp2_one_core_killed_the_other_serves(dp_server: Server) -> None:
    pids = httpx.get(f"{dp_server.url}/health").json()["engine_core_pids"]
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 120  # (a hang guard for a loaded machine)
    while (alive := dp_server.metrics()["tandem_engine_dp_replicas_alive"]) != 1:  # its sentinel fired: out of the routing
        assert time.monotonic() < deadline, alive
        time.sleep(0.05)
    health = httpx.get(f"{dp_server.url}/health")
    assert health.status_code == 200  # one core still serves
    for i in range(3):  # every request in the meantime goes to the live core
        assert chat(dp_server, f"Say {i}.", max_tokens=3, temperature=0).choices[0].message.content is not None
    deadline = time.monotonic() + 300
    while dp_server.metrics()["tandem_engine_dp_replicas_alive"] != 2:  # the killed core restarted on its own
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert dp_server.metrics()["tandem_engine_core_restarts_total"] == 1
    assert pids[1] in httpx.get(f"{dp_server.url}/health").json()["engine_core_pids"]  # the other one never stopped


def test_a_tensor_parallel_engine_core_serves(tmp_path: Path) -> None:
    """`tandem serve --tensor-parallel-size 2`: the engine core (a daemonic process) starts its worker rank, and the
    server's greedy tokens are the offline TP=1 engine's."""
    folder = str(save_tiny(tmp_path / "tiny", tiny_model("llama")))
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 20, progress=False)
    want = llm.generate(["t1 t2 t3"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = launch_server(folder, ["--dtype", "float32", "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
                                      "--log-level", "warning"], port, startup_timeout_s=300, log=log)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": "t1 t2 t3", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True, "model": Path(folder).name})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
