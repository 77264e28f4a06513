"""Engine cores as Ray actors: `tandem serve --data-parallel-size N --distributed-executor-backend ray` has Ray place
each replica's core on any node of the cluster at `$RAY_ADDRESS` (else a local Ray instance is started).

The actor runs the same `run_engine_core` as a local child and speaks the same messages over the stdlib's
`multiprocessing.connection` (TCP, authenticated with a random key the client hands it through Ray): `listen` opens a
`Listener` on the actor's node, `run` accepts the client's two connections (commands, then results) and runs the
core loop. So Ray only places and supervises: a core that dies reads as EOF on its results connection, exactly as a
local child's pipe does; Ray's error for the actor's `run` call says why; `ray.kill` ends it; a restart is a new
actor. The blocking side of the rendezvous (accept) is in the actor: a core that never comes up leaves nothing
waiting in the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tandem.runner.ray_launcher import connect_ray
from tandem.server.engine_client import CoreLauncher, EngineDeadError, RunningCore, run_engine_core

logger = logging.getLogger("tandem.server")

CONNECT_TIMEOUT_S = 60.0  # from the actor listening to both connections made (it accepts as soon as `run` starts)


class EngineCoreActor:
    """The engine core inside a Ray actor (one per replica; `run` holds it until the core leaves)."""

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def listen(self, authkey: bytes) -> tuple[tuple[str, int], int]:
        """Open the listener on this node's address: (that address, this process's pid)."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address, os.getpid()

    def run(self, model: str | None, engine_kwargs: Mapping[str, Any]) -> None:
        """Accept the client's commands and results connections, then be the engine core until shutdown."""
        if self._listener is None:
            raise RuntimeError("EngineCoreActor.run before listen")
        with self._listener as listener:
            commands, results = listener.accept(), listener.accept()
        self._listener = None
        try:
            run_engine_core(model, engine_kwargs, commands, results, os.getppid())
        finally:
            commands.close()
            results.close()


def connect(address: tuple[str, int], authkey: bytes) -> tuple[Connection, Connection]:
    """The client's two connections to a listening actor: commands, then results."""
    commands = Client(address, authkey=authkey)
    try:
        return commands, Client(address, authkey=authkey)
    except BaseException:
        commands.close()
        raise


def ray_placement(engine_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ray's resources for one replica, and its engine keywords as they apply on whichever node Ray picks.

    `replica_kwargs` placed the replica on this node (its share of these cores, its CUDA device); under Ray, on the CPU
    it asks for that share as `num_cpus` and runs that many forward threads (per tensor-parallel rank: the share over
    the ranks), unpinned, since the cores are the chosen node's; on CUDA it asks for its tensor-parallel group's GPUs,
    which Ray makes the actor's cuda:0 ... (only rank 0's when the ranks are Ray actors of their own). Replicas are
    spread over the nodes (Ray's SPREAD)."""
    kw = dict(engine_kwargs)
    tp = int(kw.get("tensor_parallel_size") or 1)
    ranks_by_ray = tp > 1 and kw.get("distributed_executor_backend") == "ray"
    own_ranks = 1 if ranks_by_ray else tp  # ranks running inside the actor (rank 0, and local worker processes)
    cores = kw.pop("cpu_cores", None)
    options: dict[str, Any] = {"scheduling_strategy": "SPREAD"}
    if str(kw.get("device", "cpu")).startswith("cuda"):
        kw["device"] = "cuda"
        options.update(num_cpus=1, num_gpus=own_ranks)
    else:
        per_rank = int(kw.get("num_threads") or max(1, len(cores or ()) // tp))
        kw["num_threads"] = per_rank
        options.update(num_cpus=per_rank * own_ranks, num_gpus=0)
    return options, kw


class RayCore(RunningCore):
    """A core in a Ray actor: `run` is its `run_engine_core` call, done when the core left or the actor died."""

    def __init__(self, ray: Any, actor: Any, run: Any, pid: int, commands: Connection, results: Connection) -> None:
        super().__init__(commands, results)
        self.ray, self.actor, self.run, self.actor_pid = ray, actor, run, pid

    @property
    def pid(self) -> int | None:
        return self.actor_pid

    def is_alive(self) -> bool:
        done, _ = self.ray.wait([self.run], timeout=0)
        return not done

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # an actor that is gone already
            self.ray.kill(self.actor, no_restart=True)

    def reap(self) -> str:
        reason = f"engine core actor (pid {self.actor_pid}) closed its connection"
        done, _ = self.ray.wait([self.run], timeout=0.5)
        if done:
            try:
                self.ray.get(self.run)
                reason = f"engine core actor (pid {self.actor_pid}) left"
            except Exception as e:  # noqa: BLE001 - Ray's account of the actor's death is the reason
                reason = f"engine core actor (pid {self.actor_pid}) died: {first_line(e)}"
        self.kill()  # its resources go back to Ray
        return reason


class RayCoreLauncher(CoreLauncher):
    """Each core a Ray actor (`ray_placement`'s resources), joined by two multiprocessing.connection connections."""

    def __init__(self) -> None:
        self.ray = connect_ray()
        self.actor_class = self.ray.remote(EngineCoreActor)

    async def start(self, model: str | None, engine_kwargs: Mapping[str, Any], timeout_s: float) -> RunningCore:
        options, kw = ray_placement(engine_kwargs)
        logger.info("engine core: placing a Ray actor (%s)", options)
        authkey = os.urandom(32)
        actor = self.actor_class.options(**options).remote()
        try:
            address, pid = await asyncio.wait_for(actor.listen.remote(authkey), timeout_s)  # placed and started
            run = actor.run.remote(model, kw)
            loop = asyncio.get_running_loop()
            commands, results = await asyncio.wait_for(loop.run_in_executor(None, connect, address, authkey),
                                                       CONNECT_TIMEOUT_S)
        except BaseException as e:
            with contextlib.suppress(Exception):  # (a connect still waiting ends with the actor)
                self.ray.kill(actor, no_restart=True)
            if isinstance(e, Exception):  # Ray's errors, OSError / EOFError / AuthenticationError, the time-outs
                raise EngineDeadError(f"engine core actor did not start: {first_line(e)}") from e
            raise
        logger.info("engine core: Ray actor pid %s at %s:%s", pid, *address)
        return RayCore(self.ray, actor, run, pid, commands, results)


def first_line(e: BaseException) -> str:
    """An exception as one short line (Ray's messages run to many)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__
