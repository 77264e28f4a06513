"""Tensor parallelism over torch.distributed: the driver's runner is rank 0, `size - 1` worker processes the others.

The scheduler, grammar work and drafting stay in the driver; per step only the `StepPlan` crosses to the workers, as
one broadcast of int32s (`encode_plan`), then each rank runs its shard of the forward (`layers/parallel.py`: one
all-reduce after each row-parallel projection and after the embedding) and the LM head's vocabulary slices are
gathered on rank 0, which samples. Backends: gloo on the CPU, NCCL on CUDA (one device per rank). Each rank is pinned
to its own share of the CPU budget's cores (`rank_cores`).

Bytes each rank hands to the collectives per step (`step_bytes`, checked against `CommMeter` in the tests), for a plan
of R requests, T tokens, B KV blocks in use (each request's blocks up to its last position), hidden size h, L layers,
model dtype of e bytes, vocabulary V over N ranks:

    plan broadcast   8 + 4 (2 + 5 R + T + B)
    embedding        4 T h                      (float32 all-reduce)
    layers           2 L T h e                  (all-reduce after o and after down)
    logits           4 R ceil(V / N)            (gather to rank 0)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.parallel import TensorParallel, even_split
from tandem.runner.base import ForwardHandle
from tandem.runner.runner import ModelRunner
from tandem.runner.tensor_thread import tensor_thread

logger = logging.getLogger("tandem")

REQUEST_FIELDS = 5  # num_tokens, start_pos, num_blocks, num_draft_tokens, flags (1 needs_logits, 2 all_logits)
WAIT_FOREVER = datetime.timedelta(days=365)  # a worker waits for the next plan however long the server idles


def blocks_in_use(r: ScheduledRequest, block_size: int) -> list[int]:
    """The blocks holding a request's positions up to its last new token (the rest of its table is not read)."""
    return r.block_table[: (r.start_pos + r.num_tokens + block_size - 1) // block_size]


def encode_plan(plan: StepPlan, block_size: int) -> list[int]:
    """A plan as int32s: [step_id, R], R x REQUEST_FIELDS, then every request's input ids and blocks in use."""
    head = [plan.step_id, len(plan.requests)]
    body: list[int] = []
    for r in plan.requests:
        blocks = blocks_in_use(r, block_size)
        head += [r.num_tokens, r.start_pos, len(blocks), r.num_draft_tokens, int(r.needs_logits) | 2 * int(r.all_logits)]
        body += r.input_ids
        body += blocks
    return head + body


def decode_plan(ints: list[int]) -> StepPlan:
    """`encode_plan`'s inverse (request ids are not sent: the workers never need them)."""
    n = ints[1]
    fields = [ints[2 + i * REQUEST_FIELDS : 2 + (i + 1) * REQUEST_FIELDS] for i in range(n)]
    at = 2 + n * REQUEST_FIELDS
    requests = []
    for i, (tokens, start, nb, drafts, flags) in enumerate(fields):
        ids, blocks = ints[at : at + tokens], ints[at + tokens : at + tokens + nb]
        at += tokens + nb
        requests.append(ScheduledRequest(str(i), ids, start, blocks, drafts, bool(flags & 1), bool(flags & 2)))
    return StepPlan(ints[0], requests)


def step_bytes(plan: StepPlan, cfg: ModelConfig, dtype: torch.dtype, size: int, block_size: int) -> dict[str, int]:
    """Payload bytes per rank per step, by collective (the formula in this module's docstring)."""
    t, r = plan.num_tokens, plan.num_logits_rows
    blocks = sum(len(blocks_in_use(q, block_size)) for q in plan.requests)
    e = torch.tensor([], dtype=dtype).element_size()
    return {
        "plan_broadcast": 8 + 4 * (2 + REQUEST_FIELDS * len(plan.requests) + t + blocks),
        "embed_all_reduce": 4 * t * cfg.hidden_size,
        "all_reduce": 2 * cfg.num_layers * t * cfg.hidden_size * e,
        "logits_gather": 4 * r * -(-cfg.vocab_size // size),
    }


class PlanChannel:
    """Rank 0 broadcasts each step's plan (or the stop signal, a length of -1) to the workers."""

    def __init__(self, tp: TensorParallel, device: torch.device, block_size: int) -> None:
        self.tp, self.block_size = tp, block_size
        self.device = device if device.type == "cuda" else torch.device("cpu")  # NCCL moves device tensors only

    def send(self, plan: StepPlan | None) -> None:
        ints = encode_plan(plan, self.block_size) if plan is not None else []
        length = torch.tensor([len(ints) if plan is not None else -1], dtype=torch.int64, device=self.device)
        self._broadcast(length)
        if ints:
            self._broadcast(torch.tensor(ints, dtype=torch.int32, device=self.device))

    def receive(self) -> StepPlan | None:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        n = int(length.item())
        if n < 0:
            return None
        payload = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._broadcast(payload)
        return decode_plan(payload.tolist())

    def _broadcast(self, t: torch.Tensor) -> None:
        self.tp.meter.add("plan_broadcast", t)
        dist.broadcast(t, src=0)


def rank_cores(cores: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """Rank `rank`'s share of `cores` (contiguous, so a rank stays on one socket when the cores are numbered by
    socket); all of them when there are fewer cores than ranks."""
    if len(cores) < size:
        return cores
    start, end = even_split(len(cores), size, rank)
    return cores[start:end]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: one device per rank, counted from the driver's; CPU: the host."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard; plain data, so it crosses the spawn boundary (or a Ray actor call)."""

    model_path: str
    dtype: str  # torch dtype name
    quantization: str | None
    device: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    use_kernels: bool
    rank: int
    size: int
    init_method: str
    cores: tuple[int, ...]  # the whole group's: each rank takes `rank_cores` of them
    num_threads: int  # per rank, at most its cores
    sees_own_gpu: bool = False  # CUDA: this rank sees only the GPU given to it, as cuda:0 (a Ray actor)

    @property
    def rank_cores(self) -> tuple[int, ...]:
        return rank_cores(self.cores, self.size, self.rank)

    @property
    def rank_threads(self) -> int:
        return max(1, min(self.num_threads, len(self.rank_cores)))

    @property
    def rank_device(self) -> torch.device:
        """This rank's device: CUDA, the driver's counted up by the rank, or cuda:0 when the rank sees only its own
        GPU (Ray sets an actor's CUDA_VISIBLE_DEVICES to the GPU it gave it); the host otherwise."""
        device = torch.device(self.device)
        if device.type == "cuda" and self.sees_own_gpu:
            return torch.device("cuda", 0)
        return rank_device(device, self.rank)


def free_tcp_address(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def join_group(spec: WorkerSpec) -> TensorParallel:
    backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.size, timeout=WAIT_FOREVER)
    return TensorParallel(spec.rank, spec.size)


def pin_thread(cores: tuple[int, ...]) -> tuple[int, ...] | None:
    """Pin the calling thread (and the threads it starts) to `cores`; the cores it had, None when it cannot."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    before = tuple(sorted(os.sched_getaffinity(0)))
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as e:
        logger.warning("tensor parallel: could not pin to cores %s: %s", list(cores), e)
        return None
    return before


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group: builds its own shard, launches the workers, broadcasts each plan."""

    def __init__(
        self, model_config: ModelConfig, weights: Mapping[str, torch.Tensor], spec: WorkerSpec, launcher: WorkerLauncher,
    ) -> None:
        if dist.is_initialized():
            raise ConfigError("a tensor-parallel engine already runs in this process (one per process: shut it down first)")
        self._launcher = launcher
        device = launcher.driver_device(torch.device(spec.device))
        self._launcher.start([dataclasses.replace(spec, rank=r) for r in range(1, spec.size)])
        tp = join_group(spec)
        if device.type == "cuda":
            tensor_thread().run(torch.cuda.set_device, device)  # NCCL works on the current device of the calling thread
        self._unpinned = tensor_thread().run(pin_thread, spec.rank_cores)
        super().__init__(model_config, weights, getattr(torch, spec.dtype), device, spec.cache, spec.scheduler,
                         num_threads=spec.rank_threads, use_kernels=spec.use_kernels, tp=tp)
        self.channel = PlanChannel(tp, self.device, self.block_size)
        self._host.run(self._share_num_blocks)
        logger.info("tensor parallel: %d ranks (%s), rank 0 on cores %s", spec.size, dist.get_backend(), list(spec.rank_cores))

    def _share_num_blocks(self) -> None:
        dist.broadcast(torch.tensor([self.num_blocks], dtype=torch.int64, device=self.channel.device), src=0)

    def prepare(self, plan: StepPlan) -> None:
        """Nothing ahead: rank 0 builds its inputs at the launch, as every rank does from the plan it is sent."""

    def launch(self, plan: StepPlan) -> ForwardHandle:
        fut = self._host.submit(self._send_and_forward, plan, *self._inputs(plan))
        return ForwardHandle(fut)

    def stats_dict(self) -> dict[str, float]:
        """Ranks, and bytes rank 0 handed to each kind of collective so far (`tp_bytes_<op>`, cumulative)."""
        meter = self.tp.meter
        return {"tp_size": self.tp.size, **{f"tp_bytes_{op}": n for op, n in meter.bytes_by_op.items()}}

    def _send_and_forward(self, plan: StepPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, float]:
        self.channel.send(plan)
        return self._forward(*inputs)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop the workers (a stop signal, then the group is torn down) and unpin the tensor thread."""
        if not dist.is_initialized():
            return
        try:
            self._host.run(self.channel.send, None)
        finally:
            self._host.run(dist.destroy_process_group)
            self._launcher.stop()
            if self._unpinned:
                self._host.run(pin_thread, self._unpinned)


def run_worker(spec: WorkerSpec) -> None:
    """A worker's life: join the group, build its shard on its tensor thread, run plans until the stop signal."""
    pin_thread(spec.rank_cores)
    die_with_parent()
    tp = join_group(spec)
    try:
        tensor_thread().run(serve_plans, spec, tp)
    except RuntimeError as e:  # gloo / NCCL: rank 0 is gone (its engine crashed or was killed); so is this rank's work
        print(f"tandem tensor-parallel rank {spec.rank}: the group broke ({str(e).splitlines()[0][:200]}); exiting",
              file=sys.stderr, flush=True)
        return
    dist.destroy_process_group()


def serve_plans(spec: WorkerSpec, tp: TensorParallel) -> None:
    from tandem.models.loader import load_checkpoint

    device = spec.rank_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_blocks = torch.zeros(1, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.broadcast(num_blocks, src=0)  # rank 0 sized the cache: every rank holds as many blocks
    cache = dataclasses.replace(spec.cache, num_blocks=int(num_blocks.item()))
    ckpt = load_checkpoint(spec.model_path, getattr(torch, spec.dtype), progress=False, quantization=spec.quantization)
    runner = ModelRunner(ckpt.config, ckpt.weights, getattr(torch, spec.dtype), device, cache, spec.scheduler,
                         num_threads=spec.rank_threads, use_kernels=spec.use_kernels, tp=tp)
    del ckpt
    channel = PlanChannel(tp, device, runner.block_size)
    while (plan := channel.receive()) is not None:
        runner._forward(*runner._inputs(plan))


def die_with_parent() -> None:
    """Linux: the worker is killed with its driver (a crashed engine core leaves no workers behind)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


class WorkerLauncher(ABC):
    """Starts and stops the worker ranks: local processes (`ProcessLauncher`) or Ray actors."""

    def driver_host(self) -> str:
        """The address the workers reach rank 0's rendezvous at."""
        return "127.0.0.1"

    def driver_device(self, device: torch.device) -> torch.device:
        """Rank 0's device (called before `start`): the given one; a launcher that hands out GPUs itself reserves
        rank 0's first, so no worker is given the same GPU."""
        return rank_device(device, 0)

    @abstractmethod
    def start(self, specs: list[WorkerSpec]) -> None:
        """Start one worker per spec (ranks 1 .. size - 1); return without waiting for them."""

    @abstractmethod
    def stop(self) -> None:
        """Wait a while for the workers to leave after the stop signal, then kill what is left."""


class ProcessLauncher(WorkerLauncher):
    """Workers as local child processes: `python -c` running `run_worker` on the spec pickled to its stdin. Plain
    subprocesses rather than multiprocessing children, so a server's engine core (itself a daemonic multiprocessing
    child, which may not have any) can start them; each dies with its parent (`die_with_parent`)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, specs: list[WorkerSpec]) -> None:
        for spec in specs:
            p = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND], stdin=subprocess.PIPE)
            assert p.stdin is not None
            p.stdin.write(pickle.dumps(spec))
            p.stdin.close()
            self.processes.append(p)

    def stop(self) -> None:
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.processes.clear()


WORKER_COMMAND = "import pickle, sys; from tandem.runner.distributed import run_worker; run_worker(pickle.load(sys.stdin.buffer))"
