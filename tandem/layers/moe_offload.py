"""Experts on the host beside an accelerator (`cpu_offload_experts`; llama.cpp's `--n-cpu-moe N` / `--cpu-moe`).

The router and experts of an offloaded layer are read into host memory and built as host projections (tandem's CPU
kernels: quantized experts stay in their blocks); attention, norms, dense MLPs, the embedding and the output
projection stay on the device. `HostExperts` stands where the layer's `MoeMlp` stood, with its call signature:

    h [T, hidden] model dtype, device  --ExpertBus.to_host-->    host: router, top k, the chosen experts (host cores)
    y [T, hidden] model dtype, host    --ExpertBus.to_device-->  device: added into the residual stream as before

What crosses the bus per offloaded layer and step is T x hidden activations each way and nothing else:
2 x T x hidden x bytes(dtype) (`bus_bytes`). The router runs on the host beside its experts: on the device it would
ship its choices too (ids [T, k] int64 + weights [T, k], 8 k + 2 k bytes a token in bf16, a second and third copy
to wait for) on top of the same h, while its matmul on the host is E x hidden MACs a token (Qwen3-30B-A3B: 128 x 2048,
a few microseconds next to its 8 experts' 37.7M weights). Qwen3-30B-A3B (hidden 2048, bf16) with all 48 layers
offloaded: 4 KiB a token a layer each way, 384 KiB a step at batch 1, 6 MiB at batch 16.

On CUDA the copy to the host lands in page-locked memory and the host waits for the device's stream before it
reads; the way back starts from a page-locked copy, so it is queued without blocking the host, which goes on to
launch the next layer. Every offloaded layer is a synchronization point (the device idles while the host computes its
experts: the next layer needs their output), which is also why such a forward is not captured in a CUDA graph. On a
CPU device (the CPU-only machine's normal path) the hop copies nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.config import ConfigError, ModelConfig
from tandem.layers.linear import Projection
from tandem.layers.moe import Expert, MoeMlp
from tandem.layers.ops import SiluMul, select_ops

logger = logging.getLogger("tandem")

HOST = torch.device("cpu")
OFFLOAD_ALL = "all"
OffloadSetting = int | str | None  # noqa: UP007 (a runtime alias on Python 3.10)


def check_offload_setting(setting: OffloadSetting) -> int | str:
    """`cpu_offload_experts` as given -> 0 (none), a layer count N, or "all"; a digit string counts as its int.
    Raises ConfigError for anything else (a negative count, another word, a bool)."""
    if setting is None:
        return 0
    if isinstance(setting, str):
        text = setting.strip().lower()
        if text == OFFLOAD_ALL:
            return OFFLOAD_ALL
        if text.isdigit():
            return int(text)
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise ConfigError(f"cpu_offload_experts must be 'all' or a number of layers >= 0, got {setting!r}")


def host_expert_layers(cfg: ModelConfig, setting: OffloadSetting) -> tuple[int, ...]:
    """The MoE layers whose experts run on the host: none for None / 0, all of them for "all", and for N those with
    an index below N, as llama.cpp's `--n-cpu-moe N` counts (its override is `blk.{i}.ffn_*_exps` for i < N: a dense
    layer among the first N has no experts to move, and N past the last layer means all). A model without experts
    gets none: the setting is a no-op there, as llama.cpp's override matches no tensor (`warn_if_no_op` says so)."""
    value = check_offload_setting(setting)
    if value == 0:
        return ()
    return cfg.moe_layers if value == OFFLOAD_ALL else tuple(i for i in cfg.moe_layers if i < int(value))


def warn_if_no_op(cfg: ModelConfig, setting: OffloadSetting) -> None:
    """Log a warning when a non-zero setting selects no layer (a dense model, or only dense layers below N)."""
    if check_offload_setting(setting) != 0 and not host_expert_layers(cfg, setting):
        logger.warning("cpu_offload_experts=%s selects no mixture-of-experts layer of this model (MoE layers: %s): "
                       "nothing is offloaded", setting, list(cfg.moe_layers) or "none")


def host_silu_mul(dtype: torch.dtype, use_kernels: bool) -> SiluMul:
    """The host's SiLU-and-multiply for experts in `dtype`: tandem's kernel when `use_kernels` and it loads, torch's
    otherwise. Only `silu_mul` of these ops ever runs, so their rotary tables are empty."""
    empty = torch.empty(0, 1)
    return select_ops(HOST, empty, empty, dtype, use_kernels).silu_mul


def bus_bytes(num_tokens: int, hidden: int, dtype: torch.dtype, num_layers: int) -> dict[str, int]:
    """Bytes one step of `num_tokens` moves across the bus with `num_layers` offloaded layers, each way."""
    each_way = num_layers * num_tokens * hidden * torch.tensor([], dtype=dtype).element_size()
    return {"to_host": each_way, "to_device": each_way}


@dataclass
class BusMeter:
    """What crossed between the device and the host experts since the last reset: bytes, copies, rows."""

    to_host: int = 0
    to_device: int = 0
    copies: int = 0
    rows: int = 0  # activation rows sent to the host (T per offloaded layer and step)

    @property
    def total(self) -> int:
        return self.to_host + self.to_device

    def reset(self) -> None:
        self.to_host = self.to_device = self.copies = self.rows = 0


class ExpertBus:
    """The hop between the device and the host experts; one per model, metered. On a CPU device it copies nothing
    and counts nothing (the tensors are the host's already)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.meter = BusMeter()

    @property
    def crosses(self) -> bool:
        """Whether activations cross a bus at all (a device other than the host)."""
        return self.device.type != HOST.type

    def to_host(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] on the device -> the same values on the host, ready to read; metered."""
        if not self.crosses:
            return h
        x = self.copy_to_host(h)
        self.meter.to_host += x.numel() * x.element_size()
        self.meter.copies += 1
        self.meter.rows += x.shape[0]
        return x

    def to_device(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, hidden] on the host -> on the device; metered."""
        if not self.crosses:
            return y
        self.meter.to_device += y.numel() * y.element_size()
        self.meter.copies += 1
        return self.copy_to_device(y)

    def copy_to_host(self, h: torch.Tensor) -> torch.Tensor:
        """The copy itself, device -> host; the host may read the result at once."""
        if h.device.type != "cuda":
            return h.to(HOST)
        # [T, hidden] page-locked (torch's caching host allocator: no cudaHostAlloc after the first steps), so the DMA
        # writes it directly instead of through a staging buffer
        x = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
        x.copy_(h, non_blocking=True)
        torch.cuda.current_stream(h.device).synchronize()  # the host reads x next: the copy must have landed
        return x

    def copy_to_device(self, y: torch.Tensor) -> torch.Tensor:
        """The copy itself, host -> device, queued behind the device's work (the host does not wait for it)."""
        if self.device.type != "cuda":
            return y.to(self.device)
        # from page-locked memory (torch's caching host allocator keeps the block until the copy is done), so the copy
        # is asynchronous and the host goes on to launch the next layer's attention
        return y.pin_memory().to(self.device, non_blocking=True)


class HostExperts:
    """A layer's `MoeMlp` held in host memory and run on the host's cores, called like it from a forward on the
    device: activations go over `bus` and back, routing and experts run on the host with the host's `silu_mul`."""

    def __init__(self, moe: MoeMlp, bus: ExpertBus, silu_mul: SiluMul) -> None:
        self.moe = moe
        self.bus = bus
        self.silu_mul = silu_mul

    @property
    def experts(self) -> list[Expert]:
        return self.moe.experts

    @property
    def router(self) -> Projection:
        return self.moe.router

    @property
    def top_k(self) -> int:
        return self.moe.top_k

    @property
    def nbytes(self) -> int:
        """Host memory the layer's router and experts occupy."""
        return self.moe.nbytes

    @property
    def active_params(self) -> int:
        return self.moe.active_params

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] on the host -> the wrapped layer's (weights [T, k], expert ids [T, k])."""
        return self.moe.route(h)

    def stack_entry(self) -> None:
        """No `DecodeStack` runs a layer whose experts sit across a bus from its attention."""
        return None

    def __call__(self, h: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:  # noqa: ARG002 - the device's silu_mul
        """h [T, hidden] (device, model dtype) -> the weighted sum of each token's k experts [T, hidden] on the
        device; changes nothing but the bus meter. The device's `silu_mul` is not used: the host's runs."""
        x = self.bus.to_host(h)  # [T, hidden] host
        y = self.moe(x, self.silu_mul)  # [T, hidden] host, on the tensor thread's OpenMP team
        return self.bus.to_device(y)
