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


class GpuHold:
    """Holds one GPU in Ray's books for a driver that is not a Ray actor itself (rank 0 of a group whose other ranks
    Ray places): `gpu` is the one Ray gave it, for the driver to use."""

    def gpu(self) -> str:
        import ray

        return str(ray.get_gpu_ids()[0])


def visible_index(physical: str, visible: str | None) -> int:
    """The CUDA index under which this process sees physical GPU `physical`, given its CUDA_VISIBLE_DEVICES."""
    if not visible:
        return int(physical)
    ids = [v.strip() for v in visible.split(",")]
    if physical not in ids:
        raise ConfigError(f"Ray reserved GPU {physical} for rank 0, but CUDA_VISIBLE_DEVICES={visible} hides it")
    return ids.index(physical)


class RayLauncher(WorkerLauncher):
    """Starts each worker rank as a Ray actor (one GPU each on CUDA; its threads' worth of CPUs)."""

    def __init__(self) -> None:
        self.ray = connect_ray()
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.hold: Any = None  # the GpuHold actor keeping rank 0's GPU out of Ray's hands

    def driver_device(self, device: torch.device) -> torch.device:
        """Rank 0 on CUDA: inside a Ray actor (an engine core Ray placed) the GPU Ray gave it, its cuda:0; otherwise a
        GPU on this node reserved from Ray first (a `GpuHold` actor), so that Ray gives every worker rank another."""
        if device.type != "cuda":
            return device
        if self.ray.get_gpu_ids():
            return torch.device("cuda", 0)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=False)
        self.hold = self.ray.remote(num_cpus=0, num_gpus=1, scheduling_strategy=here)(GpuHold).remote()
        gpu = self.ray.get(self.hold.gpu.remote())
        return torch.device("cuda", visible_index(gpu, os.environ.get("CUDA_VISIBLE_DEVICES")))

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
        for actor in [*self.actors, *([self.hold] if self.hold is not None else [])]:
            self.ray.kill(actor)
        self.actors.clear()
        self.runs.clear()
        self.hold = None
