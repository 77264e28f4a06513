"""`tandem serve --data-parallel-size 2 --distributed-executor-backend ray`: each engine core a Ray actor. First the
client's launcher seam without a process (a core that is gone reads as EOF only, as a Ray actor's connection does;
the restart asks the launcher again) and the Ray resources per replica; then a DP=2 demo-model server on a local Ray
cluster (skipped where Ray is not installed): plain and streaming requests, concurrent streams on both replicas, and
one actor's process killed by pid while the other replica serves, a new actor taking its place; and DP=2 x TP=2 with
every rank a Ray actor giving TP=1's tokens."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tandem import LLM
from tandem.params import SamplingParams
from tandem.server.engine_client import (
    CompletionDelta,
    CoreLauncher,
    EngineClient,
    EngineDeadError,
    RequestDelta,
    RunningCore,
)
from tandem.server.ray_cores import ray_placement
from tests.server.launch import running_server
from tests.server.test_data_parallel import _streams
from tests.server.test_server import API_KEY, Server, chat, demo
from tests.tiny import save_tiny, tiny_model


# --------------------------------------------------------------------------------------------- the launcher seam
class ThreadCore(RunningCore):
    """A scripted core on a thread, joined by pipes and watched by EOF alone (no sentinel): answers each request
    with its own number; the prompt "crash" makes it close its results end, as a killed actor's socket closes."""

    def __init__(self, number: int) -> None:
        cmd_reader, cmd_writer = Pipe(duplex=False)
        reader, writer = Pipe(duplex=False)
        super().__init__(cmd_writer, reader)
        self.number, self.crashed = number, False
        self.thread = threading.Thread(target=self.serve, args=(cmd_reader, writer), daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int | None:
        return 1000 + self.number

    def serve(self, commands: Connection, results: Connection) -> None:
        results.send(("ready", {"max_model_len": 64, "vocab_size": 100, "has_chat_template": False, "pid": self.pid}))
        try:
            while (cmd := commands.recv())[0] != "shutdown":
                if cmd[0] == "add" and cmd[2]["prompt"] == "crash":
                    self.crashed = True
                    return
                if cmd[0] == "add":
                    out = CompletionDelta(0, f"core {self.number}", [1], None, "stop", None)
                    results.send(("step", [("out", RequestDelta(cmd[1], 1, 0, True, None, [out]))],
                                  {"num_generated_tokens": 1}))
        except EOFError:
            pass
        finally:
            results.close()
            commands.close()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def kill(self) -> None:
        self.thread.join(1)

    def reap(self) -> str:
        return f"scripted core {self.number} {'crashed' if self.crashed else 'left'}"


class ThreadLauncher(CoreLauncher):
    def __init__(self) -> None:
        self.started: list[ThreadCore] = []

    async def start(self, model: str | None, engine_kwargs: Mapping[str, Any], timeout_s: float) -> RunningCore:
        self.started.append(ThreadCore(len(self.started)))
        return self.started[-1]


def test_engine_client_runs_over_any_launcher_and_restarts_through_it() -> None:
    launcher = ThreadLauncher()

    async def main() -> None:
        client = EngineClient(None, {}, launcher)
        info = await client.start(30)
        assert info.core_pid == client.core_pid == 1000
        first = await client.add("r1", {"prompt": "hi"}, SamplingParams()).next()
        assert first.outputs[0].text == "core 0"
        with pytest.raises(EngineDeadError, match="scripted core 0 crashed"):  # EOF alone told the client
            await client.add("r2", {"prompt": "crash"}, SamplingParams()).next()
        deadline = time.monotonic() + 30  # (a hang guard)
        while not client.alive:  # restarted through the same launcher
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert client.restarts == 1 and client.core_pids == [1001]
        again = await client.add("r3", {"prompt": "hi"}, SamplingParams()).next()
        assert again.outputs[0].text == "core 1"
        assert client.replica_states == [{"pid": 1001, "alive": True, "in_flight": 0, "generated_tokens": 1}]
        await client.shutdown(5)
        assert not launcher.started[1].is_alive()  # it left on the shutdown command

    asyncio.run(main())


def test_ray_resources_per_replica() -> None:
    """A replica asks Ray for its share of the cores (as many threads, unpinned: the cores are the node's Ray picks)
    or for its tensor-parallel group's GPUs (rank 0's alone when the ranks are Ray actors too)."""
    options, kw = ray_placement({"device": "cpu", "cpu_cores": (2, 3, 4, 5), "tensor_parallel_size": 1, "num_threads": None})
    assert (options["num_cpus"], options["num_gpus"], kw["num_threads"], "cpu_cores" in kw) == (4, 0, 4, False)
    options, kw = ray_placement({"device": "cpu", "cpu_cores": (0, 1, 2, 3), "tensor_parallel_size": 2})
    assert (options["num_cpus"], kw["num_threads"]) == (4, 2)  # two local ranks of two threads each
    options, kw = ray_placement({"device": "cpu", "cpu_cores": (0, 1, 2, 3), "tensor_parallel_size": 2,
                                 "distributed_executor_backend": "ray"})
    assert (options["num_cpus"], kw["num_threads"]) == (2, 2)  # rank 1 is an actor of its own
    options, kw = ray_placement({"device": "cuda:2", "tensor_parallel_size": 2})
    assert (options["num_gpus"], kw["device"]) == (2, "cuda")  # Ray makes its two GPUs the actor's cuda:0, cuda:1
    options, _ = ray_placement({"device": "cuda:2", "tensor_parallel_size": 2, "distributed_executor_backend": "ray"})
    assert options["num_gpus"] == 1
    assert options["scheduling_strategy"] == "SPREAD"


# ------------------------------------------------------------------------------------------- a local Ray cluster
@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster for the module; the servers join it through $RAY_ADDRESS, as on a real cluster. Its CPUs
    are Ray's bookkeeping: the demo server's 2 replicas (1 each) and the DP=2 x TP=2 server's 4 ranks fit at once."""
    ray = pytest.importorskip("ray")
    context = ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_dp_server(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve-ray-dp") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--num-kv-blocks", "160",
            "--max-queue", "32", "--request-timeout", "120", "--log-level", "warning", "--data-parallel-size", "2",
            "--distributed-executor-backend", "ray"]
    env = {**os.environ, "TANDEM_API_KEY": API_KEY, "RAY_ADDRESS": ray_address}
    with running_server(log_path, None, args, env, require_clean_exit=True) as (proc, url):
        yield Server(proc, url, log_path)


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _replicas(server: Server) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = httpx.get(f"{server.url}/health").json()["replicas"]
    return replicas


@demo
def test_ray_dp2_cores_are_actors_and_serve(ray_dp_server: Server) -> None:
    pids = httpx.get(f"{ray_dp_server.url}/health").json()["engine_core_pids"]
    assert len(set(pids)) == 2
    assert all(_parent_pid(pid) != ray_dp_server.proc.pid for pid in pids)  # Ray's worker processes, not children
    assert chat(ray_dp_server, max_tokens=4, temperature=0).choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in chat(ray_dp_server, max_tokens=6, stream=True) if c.choices)
    assert text


@demo
def test_ray_dp2_concurrent_streams_use_both_replicas(ray_dp_server: Server) -> None:
    before = [r["generated_tokens"] for r in _replicas(ray_dp_server)]
    assert all(1 <= n <= 4 for n in asyncio.run(_streams(ray_dp_server.url, 8, 4)))
    after = _replicas(ray_dp_server)
    assert all(r["alive"] and r["in_flight"] == 0 for r in after)
    assert all(r["generated_tokens"] > b for r, b in zip(after, before))  # each replica generated some of them


@demo
def test_ray_dp2_one_actor_killed_the_other_serves(ray_dp_server: Server) -> None:
    pids = httpx.get(f"{ray_dp_server.url}/health").json()["engine_core_pids"]
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 120  # (a hang guard for a loaded machine)
    while (alive := ray_dp_server.metrics()["tandem_engine_dp_replicas_alive"]) != 1:  # EOF on its connection
        assert time.monotonic() < deadline, alive
        time.sleep(0.05)
    assert httpx.get(f"{ray_dp_server.url}/health").status_code == 200  # the other replica still serves
    for i in range(2):
        assert chat(ray_dp_server, f"Say {i}.", max_tokens=3, temperature=0).choices[0].message.content is not None
    deadline = time.monotonic() + 300
    while ray_dp_server.metrics()["tandem_engine_dp_replicas_alive"] != 2:  # a new actor took its place
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert ray_dp_server.metrics()["tandem_engine_core_restarts_total"] == 1
    now = httpx.get(f"{ray_dp_server.url}/health").json()["engine_core_pids"]
    assert pids[1] in now and pids[0] not in now  # the other one never stopped
    assert all(_parent_pid(pid) != ray_dp_server.proc.pid for pid in now)
    assert chat(ray_dp_server, "Say 9.", max_tokens=3, temperature=0).choices[0].message.content is not None


def test_ray_dp2_of_tp2_every_rank_an_actor_matches_tp1(tmp_path: Path, ray_address: str) -> None:
    """DP=2 x TP=2 under Ray: each replica's core is an actor that places its rank 1 as an actor too (nested); both
    replicas give the offline TP=1 engine's greedy tokens."""
    folder = str(save_tiny(tmp_path / "tiny", tiny_model("llama")))
    llm = LLM(folder, dtype="float32", kv_cache_memory=1 << 20, progress=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    args = ["--dtype", "float32", "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--num-kv-blocks", "64",
            "--distributed-executor-backend", "ray", "--log-level", "warning"]
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    with running_server(tmp_path / "server.log", folder, args, env, startup_timeout_s=300) as (_, url):
        got = asyncio.run(_completions(url, Path(folder).name))
        replicas = httpx.get(f"{url}/health").json()["replicas"]
    assert got == want
    assert [r["generated_tokens"] > 0 for r in replicas] == [True, True]  # both replicas answered


PROMPTS = ["t1 t2 t3", "t4 t5", "t6 t7 t8 t9", "t2 t2"]


async def _completions(url: str, model: str) -> list[str]:
    """The prompts at once (so both replicas take some), greedy."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt: str) -> str:
            r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True, "model": model})
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
