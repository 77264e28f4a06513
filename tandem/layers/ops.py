"""The per-layer operations of the decoder between its projections, behind one seam.

`LayerOps` is what `LlamaModel.forward` calls between its matmuls: residual add + RMSNorm, q / k norms, RoPE +
KV-cache write, attention over the paged cache, SiLU-and-multiply. Two implementations:
  * `TorchOps`: plain torch operations, any device (on CUDA, SDPA dispatches to fused kernels);
  * `CpuKernelOps`: tandem's fused CPU kernels (`csrc/cpu_ops.cpp`), one pass per operation, attention read straight
    from the paged cache; ~4 kernel calls per layer instead of ~20 torch ops, which is what a CPU decode step costs.
`select_ops` picks one per model when the runner builds it.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.layers.attention import AttentionMetadata, paged_attention, prefill_attention, write_kv
from tandem.layers.paged_decode import flex_available

logger = logging.getLogger(__name__)

# From this many rows torch's SiLU (Sleef) runs instead of the kernel's. Without AVX-512 the kernel is a scalar loop
# that torch outruns from here; with AVX-512 the kernel is vectorised (bit-identical to the scalar loop) and faster at
# every size measured (2.9 against 5.9 us at 1 x 1,536, 10.5 against 14.1 at 8, 274 against 304 at 512; AMD EPYC), but
# torch's exp rounds differently from the kernel's: the split stays where it was, so prefill rows (and batches of 8 or
# more) keep the numbers they had (the demo Q4_1 model's greedy agreement with llama.cpp moved from >= 48 of 96 tokens
# to 38 with the kernel on every row: near-ties resolved the other way).
SILU_KERNEL_MAX_ROWS = 8


class SiluMul(Protocol):
    """`LayerOps.silu_mul`: gu [n, 2I] -> [n, I]; `tokens`, when given, is the step's token count, which chooses the
    path instead of n (a MoE layer's n pairs are k per token: a decode step of one token has k rows)."""

    def __call__(self, gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor: ...


class LayerOps(ABC):
    """Stateless operations on one step's tensors; `rope_tables` is computed once per step and shared by all layers."""

    name: str
    kv_cache_dtype: torch.dtype  # what the KV cache holds for these operations
    gathered_decode: bool  # whether `attention` needs the torch decode path's gather indices and mask
    paged_decode: bool = False  # whether decode attention reads the paged cache with FlexAttention (block tables)

    def decode_stack_tables(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(cos, sin, silu_rows) when these operations are tandem's CPU kernels, which a `DecodeStack` can call from
        C++ in their place on decode steps (`layers/decode_stack.py`); None otherwise."""
        return None

    def use_gathered_decode(self) -> None:
        """Decode attention on the gathered path from now on (no paged decode: e.g. KV blocks too small for it)."""
        if self.paged_decode:
            self.paged_decode, self.gathered_decode = False, True

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        """x [T, hidden] float32 += delta (in place, when given); returns rms_norm(x) * weight in `dtype`."""

    @abstractmethod
    def qk_norm(
        self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_heads: int
    ) -> torch.Tensor:
        """Per-head RMSNorm of q and k (Qwen3): qk [T, H + KVH, D] (rows may be strided), weights [D] in qk's dtype
        -> [T, H + KVH, D], the first `num_heads` heads normed with q_weight, the rest with k_weight."""

    @abstractmethod
    def rope_tables(self, positions: torch.Tensor) -> object:
        """Whatever `rope_write_kv` needs for this step's positions [T]."""

    @abstractmethod
    def rope_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, rope: object, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int
    ) -> torch.Tensor:
        """qk [T, H + KVH, D], v [T, KVH, D]: rotates q and k, stores k and v at `meta.slot_mapping` in `kv_cache`;
        returns the rotated qk [T, H + KVH, D]."""

    @abstractmethod
    def attention(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
        scale: float, dtype: torch.dtype, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's queries (qk[:, :H]) over their requests' cached keys -> [T, H * D] in `dtype`;
        with a sliding `window` each query sees only the last `window` keys (itself included); `sinks` [H] float32:
        each head's sink logit joins its softmax's denominator (gpt-oss; the torch operations only)."""

    @abstractmethod
    def silu_mul(self, gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        """gu [n, 2I] -> silu(gu[:, :I]) * gu[:, I:] [n, I]; `tokens`: the step's tokens, where n is not (`SiluMul`)."""


class TorchOps(LayerOps):
    name = "torch"
    gathered_decode = True

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kv_cache_dtype: torch.dtype, paged_decode: bool = False) -> None:
        self.paged_decode = paged_decode
        self.gathered_decode = not paged_decode
        self.cos = cos  # [max_pos, D] = [cos, cos], model dtype
        self.sin = sin  # [max_pos, D] = [-sin, sin]
        # float32 on the CPU: the torch attention there is matmuls in the cache's dtype, and bf16 matmuls would round
        self.kv_cache_dtype = kv_cache_dtype

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (x.shape[-1],), weight, eps).to(dtype)

    def qk_norm(
        self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_heads: int
    ) -> torch.Tensor:
        D = qk.shape[-1]
        q = F.rms_norm(qk[:, :num_heads], (D,), q_weight, eps)
        return torch.cat([q, F.rms_norm(qk[:, num_heads:], (D,), k_weight, eps)], dim=1)

    def rope_tables(self, positions: torch.Tensor) -> object:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D] each

    def rope_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, rope: object, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int
    ) -> torch.Tensor:
        assert isinstance(rope, tuple)
        cos, sin = rope  # [T, 1, D] each
        half = qk.shape[-1] // 2
        # rotate-half RoPE on q and k together: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin
        write_kv(kv_cache, qk[:, num_heads:], v, meta.slot_mapping)
        return qk

    def attention(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
        scale: float, dtype: torch.dtype, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        return paged_attention(q, k, v, kv_cache, meta, scale, window, sinks).to(dtype)

    def silu_mul(self, gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u


class CpuKernelOps(LayerOps):
    """tandem's fused CPU kernels; the math is float32 whatever the cache holds, except prefill attention over a
    bf16 cache on a CPU with AMX tiles: there SDPA runs in bf16 (its matmuls on the tiles, float32 softmax and
    accumulation), 3.1x float32's time at 1,000 tokens (12.2 -> 3.9 ms a layer, SmolLM2-135M's 9 x 64 heads, Xeon),
    as HF transformers in bf16 does. `TANDEM_PREFILL_ATTENTION=float32` keeps float32 there too.

    Cache layout: each K block is stored transposed, [head_dim, block_size], so that decode attention computes a
    block's scores as vector FMAs across keys; V blocks stay [block_size, head_dim]. Blocks remain the unit of
    allocation, prefix sharing and rollback, so nothing outside the attention code sees the difference.
    """

    name = "tandem-cpu"
    gathered_decode = False

    def __init__(self, cos_half: torch.Tensor, sin_half: torch.Tensor, dtype: torch.dtype) -> None:
        # K/V in the model dtype, as the reference holds them (rotated k is already rounded to it): half the bytes
        # of float32, which at 32 requests x 200 tokens is as much memory traffic per step as the weights
        self.kv_cache_dtype = dtype
        # rounded to the model dtype as the torch path holds them, kept as float32 for the kernel
        self.cos = cos_half.to(dtype).float().contiguous()  # [max_pos, D / 2]
        self.sin = sin_half.to(dtype).float().contiguous()
        self.ops = torch.ops.tandem
        self.prefill_dtype = prefill_attention_dtype(dtype)

    def decode_stack_tables(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return self.cos, self.sin, SILU_KERNEL_MAX_ROWS

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        return self.ops.add_rms_norm(x, delta, weight, eps, dtype)

    def qk_norm(
        self, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_heads: int
    ) -> torch.Tensor:
        return self.ops.qk_rms_norm(qk, q_weight, k_weight, eps, num_heads)  # one call for 2 norms and a cat

    @staticmethod
    def to_standard_layout(kv_cache: torch.Tensor) -> torch.Tensor:
        """A copy of one layer's cache with K blocks as [block_size, D] (the torch operations' layout)."""
        _, KVH, NB, BS, D = kv_cache.shape
        return torch.stack([kv_cache[0].view(KVH, NB, D, BS).transpose(-1, -2), kv_cache[1]])

    @staticmethod
    def from_standard_layout(kv_cache: torch.Tensor) -> torch.Tensor:
        """A copy of a cache in the torch operations' layout, with K blocks transposed as these kernels read them."""
        _, KVH, NB, BS, D = kv_cache.shape
        return torch.stack([kv_cache[0].transpose(-1, -2).contiguous().view(KVH, NB, BS, D), kv_cache[1]])

    def rope_tables(self, positions: torch.Tensor) -> object:
        return positions

    def rope_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, rope: object, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int
    ) -> torch.Tensor:
        return self.ops.rope_write_kv(qk, v, rope, self.cos, self.sin, kv_cache, meta.slot_mapping, num_heads)

    def attention(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
        scale: float, dtype: torch.dtype, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T, _, D = qk.shape
        q = qk[:, :num_heads]  # [T, H, D] float32, rows strided
        out = torch.empty(T, num_heads * D, dtype=dtype)
        if meta.decode is not None:
            self.ops.paged_attention(q, kv_cache, meta.decode.seq_info, meta.decode.block_tables, scale, out, window or 0,
                                     sinks)
        if meta.prefills:
            view = out.view(T, num_heads, D)
            for p in meta.prefills:
                s = p.token_slice
                view[s] = prefill_attention(q[s], qk[s, num_heads:], v[s], kv_cache, p, scale, k_transposed=True,
                                            window=window, math_dtype=self.prefill_dtype, sinks=sinks).to(dtype)
        return out

    def silu_mul(self, gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        if (gu.shape[0] if tokens is None else tokens) >= SILU_KERNEL_MAX_ROWS:
            g, u = gu.chunk(2, dim=-1)
            return F.silu(g) * u
        return self.ops.silu_mul(gu)  # a decode step: one call instead of three ops' dispatch


def prefill_attention_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """bf16 for a bf16 cache on a CPU with AMX bf16 tiles (where bf16 SDPA pays), else float32."""
    from tandem.cpu_features import cpu_features

    wanted = os.environ.get("TANDEM_PREFILL_ATTENTION", "auto").strip().lower()
    if wanted not in ("auto", "float32", "fp32", "bfloat16", "bf16"):
        logger.warning("TANDEM_PREFILL_ATTENTION=%r is not one of auto, float32, bfloat16: using auto", wanted)
    if wanted in ("float32", "fp32"):
        return torch.float32
    if cache_dtype == torch.bfloat16 and (wanted in ("bfloat16", "bf16") or cpu_features().has("amx_tile", "amx_bf16")):
        return torch.bfloat16
    return torch.float32


def select_ops(
    device: torch.device, cos_half: torch.Tensor, sin_half: torch.Tensor, dtype: torch.dtype, use_kernels: bool,
    sinks: bool = False,
) -> LayerOps:
    """The fused CPU kernels on a CPU when wanted and buildable (attention sinks included); torch operations
    otherwise. A model with attention `sinks` (gpt-oss) on the torch operations takes the gathered decode path:
    FlexAttention decode has no sinks."""
    if use_kernels and device.type == "cpu":
        from tandem.layers.kernels import load_cpu_kernels

        if load_cpu_kernels():
            return CpuKernelOps(cos_half, sin_half, dtype)
    cos = torch.cat([cos_half, cos_half], dim=-1).to(device=device, dtype=dtype)
    sin = torch.cat([-sin_half, sin_half], dim=-1).to(device=device, dtype=dtype)
    ops = TorchOps(cos, sin, torch.float32 if device.type == "cpu" else dtype, paged_decode=use_paged_decode(device))
    if sinks:
        ops.use_gathered_decode()
    return ops


def use_paged_decode(device: torch.device) -> bool:
    """FlexAttention over the paged cache for decode on CUDA (when this torch has it); the gathered SDPA path
    elsewhere, or anywhere with TANDEM_DECODE_ATTENTION=gather (=paged forces FlexAttention, eager off CUDA)."""
    choice = os.environ.get("TANDEM_DECODE_ATTENTION", "auto")
    if choice == "gather" or not flex_available():
        return False
    return choice == "paged" or device.type == "cuda"
