"""Tensor-parallel worker ranks as Ray actors (`distributed_executor_backend="ray"`): the same `run_worker` as the
local processes, placed by Ray on any node of the cluster (`$RAY_ADDRESS`, else a local Ray instance is started).
Ray is optional (`pip install ray`); the ranks still talk over torch.distributed (gloo / NCCL) to the driver's
address, Ray only places and supervises them."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from tandem.config import ConfigError
from tandem.runner.distributed import WorkerLauncher, WorkerSpec, run_worker

logger = logging.getLogger("tandem")


class RankActor:
    """One worker rank inside a Ray actor process; `run` returns when the driver sends the stop signal."""

    def run(self, spec: WorkerSpec) -> int:
        run_worker(spec)
        return spec.rank


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install ray") from e
    return ray


def connect_ray() -> Any:
    """The `ray` module, connected to the cluster at `$RAY_ADDRESS` (else a local Ray instance is started); inside a
    Ray actor (an engine core placed by Ray) it is connected already."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    return ray


class RayLauncher(WorkerLauncher):
    """Starts each worker rank as a Ray actor (one GPU each on CUDA; its threads' worth of CPUs)."""

    def __init__(self) -> None:
        self.ray = connect_ray()
        self.actors: list[Any] = []
        self.runs: list[Any] = []

    def driver_host(self) -> str:
        """The address the workers reach the driver's rendezvous at: this node's, as Ray knows it."""
        return str(self.ray.util.get_node_ip_address())

    def start(self, specs: list[WorkerSpec]) -> None:
        """One actor per rank, on the driver's node while it has room (soft affinity: a group keeps its all-reduces
        off the network when it fits one node), elsewhere in the cluster otherwise."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=True)
        for spec in specs:
            gpus = 1 if torch.device(spec.device).type == "cuda" else 0
            actor_cls = self.ray.remote(num_cpus=spec.rank_threads, num_gpus=gpus, scheduling_strategy=here)(RankActor)
            actor = actor_cls.options(name=None).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(dataclasses.replace(spec, sees_own_gpu=gpus > 0)))
        logger.info("tensor parallel: %d worker ranks placed by Ray", len(specs))

    def stop(self) -> None:
        try:
            self.ray.get(self.runs, timeout=10)
        except Exception as e:  # noqa: BLE001 - a rank that died already is what stopping wanted
            logger.warning("tensor parallel: Ray workers did not stop cleanly: %s", e)
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors.clear()
        self.runs.clear()
