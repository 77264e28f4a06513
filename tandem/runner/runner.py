"""The model runner: owns the model, the KV cache tensors and the device; runs one `StepPlan` per step.

`launch(plan)` prepares inputs and starts the forward on the process's tensor thread (`tensor_thread.py`) (torch releases the GIL inside its ops, and
on an accelerator the kernels queue asynchronously), so the caller's CPU work (grammar masks, drafting) overlaps it;
`collect(handle)` waits and returns the logits rows the plan asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import StepPlan
from tandem.core.plan_arrays import PlanRows
from tandem.layers.attention import AttentionMetadata, paged_step_inputs, step_inputs
from tandem.layers.moe_offload import OffloadSetting, host_expert_layers, warn_if_no_op
from tandem.layers.parallel import TensorParallel
from tandem.models.llama import LlamaModel
from tandem.runner.base import ForwardHandle, Runner
from tandem.runner.cuda_graphs import (
    GraphedSteps,
    GraphInputs,
    capture_cuda_graph,
    capture_eagerly,
    graphs_enabled,
)
from tandem.runner.launch_inputs import EagerInputs, LaunchInputs
from tandem.runner.memory import huge_page_zeros, release_freed_memory, resident_bytes, resident_range_bytes
from tandem.runner.tensor_thread import tensor_thread
from tandem.runner.timeline import DeviceTimeline

T = TypeVar("T")
MIN_PAGED_BLOCK = 16  # the smallest KV block FlexAttention's compiled CUDA kernels take as a sparse block
logger = logging.getLogger("tandem")


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on `device` (MemAvailable on the host, free device memory otherwise)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`device` made the current CUDA device for the block (streams, events and graphs are per device, and the
    tensor thread's current device is cuda:0 whatever the runner's); nothing to switch elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def wait_for_device(device: torch.device) -> None:
    """Block until the work queued on `device`'s current stream is done: that device's, not the current one's
    (a runner on cuda:1 synchronizing cuda:0 would time nothing). Nothing to wait for on the host."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


RESIDENT_EVERY_S = 10.0
DEFAULT_MEMORY_FRACTION = 0.5
# The host's default KV pool cap: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE unset: 4 GiB). Half the RAM of a shared
# host (11 GiB here) filled over a day as the prefix cache kept blocks; 4 GiB holds 180K tokens of the demo model
# (bf16) and 8K of a Llama-2-7B, and an operator who wants more says so. docs/operations.md.
HOST_KV_DEFAULT = 4 << 30


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class KvCachePlan:
    """How many KV blocks the cache holds, and why."""

    num_blocks: int
    block_size: int
    block_bytes: int
    dtype: torch.dtype
    reason: str

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        dtype = str(self.dtype).removeprefix("torch.")
        return f"KV cache {self.nbytes / 2**30:.2f} GiB {dtype}: {self.num_blocks} blocks x {self.block_size} = {tokens} tokens ({self.reason})"


def plan_kv_cache(
    cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype, device: torch.device
) -> KvCachePlan:
    """Blocks for the work: `max_num_seqs` requests of `max_model_len` tokens, capped at `memory_fraction` (default
    0.5) of the memory available now (after the weights) and, on the host when no fraction is given, at
    HOST_KV_DEFAULT; `kv_cache_memory` (bytes) or `num_blocks` set it outright. `share` scales the caps (replicas
    on one host)."""
    per_block = kv_block_bytes(cfg, cache.block_size, dtype)

    def plan(num: int, reason: str) -> KvCachePlan:
        if num < 1:
            raise ConfigError(f"the KV cache holds no block of {per_block} bytes ({reason}); raise kv_cache_memory or memory_fraction")
        return KvCachePlan(int(num), cache.block_size, per_block, dtype, reason)

    if cache.num_blocks is not None:
        return plan(cache.num_blocks, "num_kv_blocks")
    if cache.kv_cache_memory is not None:
        return plan(cache.kv_cache_memory // per_block, f"kv_cache_memory {cache.kv_cache_memory / 2**30:.2f} GiB")
    blocks_per_seq = -(-sched.max_model_len // cache.block_size) + 1
    demand = sched.max_num_seqs * blocks_per_seq
    work = f"max_num_seqs {sched.max_num_seqs} x max_model_len {sched.max_model_len}"
    free = available_memory(device)
    fraction = (cache.memory_fraction or DEFAULT_MEMORY_FRACTION) * cache.share
    caps = [(int(free * fraction) // per_block, f"memory_fraction {fraction:g} of {free / 2**30:.1f} GiB available")]
    if device.type == "cpu" and cache.memory_fraction is None:
        host = int(HOST_KV_DEFAULT * cache.share)
        caps.append((host // per_block, f"the host default {host / 2**30:.2f} GiB (--kv-cache-memory or --memory-fraction to change)"))
    cap, why = min(caps)
    if demand <= cap:
        return plan(demand, work)
    return plan(cap, f"{work} capped at {why}")


def plan_num_blocks(
    cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """KV blocks of `plan_kv_cache`."""
    return plan_kv_cache(cfg, cache, sched, dtype, device).num_blocks


class ModelRunner(Runner):
    """One device: model weights, paged KV cache, input preparation, launch / collect. With `tp`, one tensor-parallel
    rank's shard of the model and of the KV cache (its kv heads); `runner/distributed.py` runs the group."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        num_threads: int | None = None,
        use_kernels: bool = True,
        cuda_graphs: bool | None = None,
        tp: TensorParallel | None = None,
        cpu_offload_experts: OffloadSetting = None,
    ) -> None:
        """`cpu_offload_experts`: the MoE layers whose experts are held and run on the host ("all", or N: those
        below layer N, as llama.cpp's `--n-cpu-moe N`; `layers/moe_offload.py`)."""
        self.device = torch.device(device)
        self.tp = tp or TensorParallel()
        self.host_expert_layers = host_expert_layers(model_config, cpu_offload_experts)
        warn_if_no_op(model_config, cpu_offload_experts)
        if self.host_expert_layers and self.tp.enabled:
            raise ConfigError("cpu_offload_experts does not combine with tensor parallelism (each rank would need "
                              "its slice of the experts on its own host cores); use one of them")
        self.model_config = model_config
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self._host = tensor_thread()
        self._pin = self.device.type == "cuda"
        self.timeline: DeviceTimeline | None = None  # set to mark each forward's start and end (the device check)
        # built on the tensor thread: weight packing and cache allocation are parallel regions, and a second OpenMP
        # team (on the caller's thread) would slow every later forward (see tandem/runner/tensor_thread.py)
        self._graphs: GraphedSteps | None = None
        self._graphs_paused = False
        # not under tensor parallelism: its ranks run each step's collectives in lockstep, eagerly; nor with experts
        # on the host beside an accelerator: a captured graph cannot leave the device for the host's experts mid-way
        wanted = graphs_enabled(self.device) if cuda_graphs is None else cuda_graphs
        if wanted and self._experts_cross_bus:
            logger.info("CUDA graphs off: the experts of layers %s run on the host", list(self.host_expert_layers))
        self._want_graphs = wanted and not self.tp.enabled and not self._experts_cross_bus
        self._host.run(self._build, weights, cache_config, scheduler_config, num_threads, use_kernels)
        self._graphs = self._graphed_steps(scheduler_config.max_model_len)
        # the next plan read (and, on an accelerator, its inputs built) while the forward before it runs
        self._launch_inputs = LaunchInputs(self.block_size, self.device, self._graphs_now, self._inputs,
                                           build_ahead=self._may_build_ahead, eager_from_op=self._inputs_from_op)
        self._capturing = False  # the forward in flight captures a CUDA graph first

    def _build(
        self, weights: Mapping[str, torch.Tensor], cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        num_threads: int | None, use_kernels: bool,
    ) -> None:
        if self.forward_uses_host_cores:  # the whole forward, or the experts of host layers, on these cores
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        self._num_threads = torch.get_num_threads()
        model_config, dtype = self.model_config, self.dtype
        self.model = LlamaModel(model_config, weights, dtype, self.device, use_kernels=use_kernels, tp=self.tp,
                                after_layer=release_freed_memory, host_expert_layers=self.host_expert_layers)
        if self.device.type == "cuda" and self.block_size < MIN_PAGED_BLOCK:
            self.model.ops.use_gathered_decode()  # the compiled kernel's tiles are at least 16 keys: one block each
        release_freed_memory()  # the load's temporaries are gone; hand their pages back before sizing the cache
        self.kv_dtype = self.model.ops.kv_cache_dtype
        self.kv_plan = plan_kv_cache(self.model.cfg, cache_config, scheduler_config, self.kv_dtype, self.device)
        self.num_blocks = self.kv_plan.num_blocks
        # with CUDA graphs, one block beyond the scheduler's: the scratch block their padding rows write and read
        shape = self.model.kv_cache_shape(self.num_blocks + int(self._want_graphs), self.block_size)
        # zero-filled: padded key slots are masked, but 0 * NaN from uninitialised memory would still poison the output.
        # On the host the zeros are fresh anonymous pages, resident only once a block is written.
        if self.device.type == "cpu":
            self.kv_caches = [self._host_cache(shape) for _ in range(model_config.num_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(model_config.num_layers)]
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.kv_block_bytes = self.kv_plan.block_bytes
        self._resident: tuple[float, int, int] = (float("-inf"), -1, 0)  # (when measured, blocks touched, bytes)
        self.weight_bytes = self.model.weight_bytes
        logger.info("%s", self.memory_summary())

    def _host_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's host cache [2, KVH, NB, BS, D]. For the CPU kernels (which take any head and block strides) it
        is stored block-major, [2, NB, KVH, BS, D]: a block of every head is contiguous, so the first requests commit
        one 2 MiB page per layer and K/V instead of one per kv head (24 layers x 32 heads x 2 x 2 MiB = 3 GiB for a
        1.7B model's first token otherwise)."""
        if self.model.ops.name != "tandem-cpu":
            return huge_page_zeros(shape, self.kv_dtype)
        two, kvh, nb, bs, d = shape
        return huge_page_zeros((two, nb, kvh, bs, d), self.kv_dtype).permute(0, 2, 1, 3, 4)

    def kv_cache_resident_bytes(self, touched_blocks: int) -> int:
        """Bytes of a host KV cache committed now (`mincore` over its pages: 4 ms for a 22 GiB pool), re-read when
        the blocks ever used grew past the last reading or RESIDENT_EVERY_S passed; a device cache is all allocated."""
        if self.device.type != "cpu":
            return self.kv_cache_bytes
        when, touched, value = self._resident
        now = time.monotonic()
        if touched != touched_blocks or now - when >= RESIDENT_EVERY_S:
            sizes = [resident_range_bytes(t) for t in self.kv_caches]
            value = sum(x for x in sizes if x is not None) if all(x is not None for x in sizes) else self.kv_cache_bytes
            self._resident = (now, touched_blocks, value)
        return value

    @property
    def _experts_cross_bus(self) -> bool:
        """Some layers' experts run on the host while the rest of the forward runs on an accelerator."""
        return bool(self.host_expert_layers) and self.device.type != "cpu"

    @property
    def forward_uses_host_cores(self) -> bool:
        """A CPU device, or experts on the host: host work beside the forward competes with it for the cores."""
        return self.device.type == "cpu" or bool(self.host_expert_layers)

    @property
    def host_expert_bytes(self) -> int:
        """Host memory the offloaded layers' routers and experts occupy (0 when none is offloaded)."""
        return sum(layer.moe.nbytes for i, layer in enumerate(self.model.layers)
                   if i in self.host_expert_layers and layer.moe is not None)

    def stats_dict(self) -> dict[str, float]:
        """Bytes and copies that crossed between the device and the host experts so far (none without them)."""
        if not self._experts_cross_bus:
            return {}
        meter = self.model.expert_bus.meter
        return {"expert_bus_bytes": meter.total, "expert_bus_copies": meter.copies}

    def memory_summary(self) -> str:
        """Weights as held (the host experts' share named), the KV cache as planned, and the process's resident
        memory now and at its peak."""
        rss, peak = resident_bytes()
        host = f" ({self.host_expert_bytes / 2**30:.2f} GiB of experts on the host)" if self._experts_cross_bus else ""
        return (
            f"weights {self.weight_bytes / 2**30:.2f} GiB{host}, {self.kv_plan.describe()}; "
            f"RSS {rss / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB)"
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def prepare(self, plan: StepPlan) -> None:
        self._launch_inputs.prepare(plan)

    @property
    def launches_unsettled(self) -> bool:
        return self._launch_inputs.ahead.patches

    def launch(self, plan: StepPlan) -> ForwardHandle:
        """Start the forward of `plan` and return at once; the CPU is free until `collect`."""
        inputs = self._launch_inputs(plan)[1]
        self._capturing = self._launch_inputs.captures(inputs)
        if inputs.graph is not None:
            return ForwardHandle(self._host.submit(self._replay, inputs.graph))
        assert inputs.eager is not None
        return ForwardHandle(self._host.submit(self._forward, *inputs.eager))

    def _may_build_ahead(self) -> bool:
        """Whether the next launch's inputs may be built now, beside the forward in flight (see `LaunchInputs`)."""
        return not self.forward_uses_host_cores and not self._capturing

    def _graphs_now(self) -> GraphedSteps | None:
        """The graphed steps a launch may use now (None: eager)."""
        return self._graphs if self.cuda_graphs else None

    def _inputs(self, plan: StepPlan, rows: PlanRows | None = None) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The forward's inputs on the device: token ids [T], attention metadata, logits rows [R]."""
        ops = self.model.ops
        return step_inputs(plan, self.block_size, self.device, pin=self._pin, gathered_decode=ops.gathered_decode,
                           paged_decode=ops.paged_decode, rows=rows)

    def _inputs_from_op(self, rows: PlanRows, out: Sequence[torch.Tensor]) -> EagerInputs | None:
        """`_inputs` from the op library's `step_inputs` outputs for `rows`, where the eager steps take its paged
        path (FlexAttention's paged decode); None otherwise."""
        ops = self.model.ops
        if not ops.paged_decode or ops.gathered_decode:
            return None
        return paged_step_inputs(rows, out, self.device, pin=self._pin)

    def on_tensor_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` where the forward runs (the process's tensor thread) and wait for it: host-side tensor work
        (sampling, verification) belongs there, not on the caller's thread (see tandem/runner/tensor_thread.py)."""
        return self._host.run(fn, *args)

    def set_num_threads(self, n: int) -> None:
        """Threads of the forward on the CPU from the next step on (no-op when unchanged)."""
        if n != self._num_threads:
            self._num_threads = n
            self._host.run(torch.set_num_threads, n)

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        timeline = self.timeline
        with on_device(self.device):
            if timeline is not None:
                timeline.record_start()
            hidden = self.model.forward(input_ids, meta, self.kv_caches)  # [T, hidden]
            logits = self.model.logits(hidden[rows])  # [R, V]
            if timeline is not None:
                timeline.record_end()
        wait_for_device(self.device)
        return logits, time.perf_counter()

    @torch.inference_mode()
    def _replay(self, inputs: GraphInputs) -> tuple[torch.Tensor, float]:
        """A decode / verification step through its CUDA graph (captured on first use of its bucket)."""
        assert self._graphs is not None
        with on_device(self.device):
            if self.timeline is not None:
                self.timeline.record_start()
            logits = self._graphs.run(inputs)  # [R, V]
            if self.timeline is not None:
                self.timeline.record_end()
        wait_for_device(self.device)
        return logits, time.perf_counter()

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode / verification steps run through CUDA graphs now."""
        return self._graphs is not None and not self._graphs_paused

    def graph_stats(self) -> dict[str, int]:
        """Graphs captured and steps replayed through them so far."""
        steps = self._graphs.steps.values() if self._graphs is not None else []
        return {"graphs_captured": len(steps), "graph_steps": sum(s.replays for s in steps)}

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Pause (or resume) the graphs: paused, every step runs eagerly; captured graphs are kept for resuming."""
        self._graphs_paused = not enabled

    def _graphed_steps(self, max_model_len: int) -> GraphedSteps | None:
        """CUDA graphs for decode / verification steps when on (default: on CUDA, with the paged decode attention)."""
        if not self._want_graphs or not self.model.ops.paged_decode:
            return None
        capture = capture_cuda_graph(torch.cuda.graph_pool_handle()) if self.device.type == "cuda" else capture_eagerly
        model = self.model
        return GraphedSteps(
            forward=lambda ids, meta: model.logits(model.forward(ids, meta, self.kv_caches)),
            capture=capture, device=self.device, block_size=self.block_size, scratch_block=self.num_blocks,
            max_blocks=min(-(-max_model_len // self.block_size) + 1, self.num_blocks),  # no request holds more
        )

    def shutdown(self) -> None:
        """Nothing to stop: the tensor thread is the process's and outlives the runner."""
