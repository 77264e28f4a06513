"""The model runner: owns the model, the KV cache tensors and the device; runs one `StepPlan` per step.

`launch(plan)` prepares inputs and starts the forward on the process's tensor thread (`tensor_thread.py`) (torch releases the GIL inside its ops, and
on an accelerator the kernels queue asynchronously), so the caller's CPU work (grammar masks, drafting) overlaps it;
`collect(handle)` waits and returns the logits rows the plan asked for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import StepPlan
from tandem.layers.attention import AttentionMetadata, build_metadata
from tandem.models.llama import LlamaModel
from tandem.runner.memory import huge_page_zeros
from tandem.runner.tensor_thread import tensor_thread

T = TypeVar("T")


@dataclass
class ForwardHandle:
    """A launched forward; `collect` turns it into logits."""

    future: Future[tuple[torch.Tensor, float]]
    num_rows: int
    finished_at: float = 0.0  # perf_counter() when the forward finished (set by collect)


DEFAULT_CPU_KV_BYTES = 4 * 2**30  # the default KV budget on the host when none is given (as vLLM's CPU backend)


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


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


def plan_num_blocks(
    cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """KV blocks that fit the budget, capped at what `max_num_seqs` full-length requests could ever use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_block_bytes(cfg, cache.block_size, dtype)
    budget = cache.kv_cache_memory
    if budget is None:
        budget = int(available_memory(device) * cache.memory_fraction)
        if device.type == "cpu":
            budget = min(budget, DEFAULT_CPU_KV_BYTES)  # host memory is shared with everything else
    blocks_per_seq = -(-sched.max_model_len // cache.block_size) + 1
    num = min(budget // per_block, sched.max_num_seqs * blocks_per_seq)
    if num < 1:
        raise ConfigError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; raise kv_cache_memory or memory_fraction"
        )
    return int(num)


class ModelRunner:
    """One device: model weights, paged KV cache, input preparation, launch / collect."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        num_threads: int | None = None,
        use_kernels: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.model_config = model_config
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self._host = tensor_thread()
        self._pin = self.device.type == "cuda"
        # built on the tensor thread: weight packing and cache allocation are parallel regions, and a second OpenMP
        # team (on the caller's thread) would slow every later forward (see tandem/runner/tensor_thread.py)
        self._host.run(self._build, weights, cache_config, scheduler_config, num_threads, use_kernels)

    def _build(
        self, weights: dict[str, torch.Tensor], cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        num_threads: int | None, use_kernels: bool,
    ) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        self._num_threads = torch.get_num_threads()
        model_config, dtype = self.model_config, self.dtype
        self.model = LlamaModel(model_config, weights, dtype, self.device, use_kernels=use_kernels)
        self.kv_dtype = self.model.ops.kv_cache_dtype
        self.num_blocks = plan_num_blocks(model_config, cache_config, scheduler_config, self.kv_dtype, self.device)
        shape = self.model.kv_cache_shape(self.num_blocks, self.block_size)
        # zero-filled: padded key slots are masked, but 0 * NaN from uninitialised memory would still poison the output
        if self.device.type == "cpu":
            self.kv_caches = [huge_page_zeros(shape, self.kv_dtype) for _ in range(model_config.num_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(model_config.num_layers)]
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in self.kv_caches)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def launch(self, plan: StepPlan) -> ForwardHandle:
        """Start the forward of `plan` and return at once; the CPU is free until `collect`."""
        input_ids = self._to_device([t for r in plan.requests for t in r.input_ids])
        meta = build_metadata(plan, self.block_size, self.device, pin=self._pin, gathered_decode=self.model.ops.gathered_decode)
        rows = self._to_device(self._logits_rows(plan))
        fut = self._host.submit(self._forward, input_ids, meta, rows)
        return ForwardHandle(fut, plan.num_logits_rows)

    def collect(self, handle: ForwardHandle) -> torch.Tensor:
        """Wait for the forward; logits [R, V] float32 on the device, R = plan.num_logits_rows, in plan order."""
        logits, handle.finished_at = handle.future.result()
        return logits

    def on_tensor_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` where the forward runs (the process's tensor thread) and wait for it: host-side tensor work
        (sampling, verification) belongs there, not on the caller's thread (see tandem/runner/tensor_thread.py)."""
        return self._host.run(fn, *args)

    def set_num_threads(self, n: int) -> None:
        """Threads of the forward on the CPU from the next step on (no-op when unchanged)."""
        if n != self._num_threads:
            self._num_threads = n
            self._host.run(torch.set_num_threads, n)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        hidden = self.model.forward(input_ids, meta, self.kv_caches)  # [T, hidden]
        logits = self.model.logits(hidden[rows])  # [R, V]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return logits, time.perf_counter()

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def _logits_rows(plan: StepPlan) -> list[int]:
        """Rows of the flattened batch whose logits are wanted: each request's last 1 + drafts rows (all when asked)."""
        rows: list[int] = []
        row0 = 0
        for r in plan.requests:
            n = r.num_logits_rows
            end = row0 + r.num_tokens
            rows.extend(range(end - n, end))
            row0 = end
        return rows

    def shutdown(self) -> None:
        """Nothing to stop: the tensor thread is the process's and outlives the runner."""
