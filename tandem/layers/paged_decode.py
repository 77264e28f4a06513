"""Decode attention read straight from the paged KV cache with torch's FlexAttention (the CUDA path).

The torch decode group (`attention.py`) gathers every request's keys padded to the longest request and hands SDPA a
float mask [B, q_max, L], which rules out the flash kernel and moves B x L_max x KVH x D x 2 bytes per layer. Here
nothing is gathered: the keys are the layer's whole cache seen as one sequence, `kv_cache[0]` viewed
[1, KVH, NB * BS, D], and a `BlockMask` whose KV block is the cache block (BS slots) lists each request's
physical blocks straight from its block table. FlexAttention's kernel visits only the listed blocks; the mask
function decides the slots within them: a physical block's logical index in the request
(`block_logical[b, block]`, -1 when it is not the request's) gives each key slot's position, visible when at or
before the query's (and within the sliding window). The math runs in the cache's dtype.

Compiled (`torch.compile(flex_attention)`) on CUDA; eager on the CPU, where it is the reference FlexAttention
implementation that materializes the scores (fine for tests, never the CPU's serving path).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# one query block holds every query of a request (q_max <= 16); the compiled decoding kernel needs the sparse query
# block to be a multiple of its BLOCK_M (the next power of 2 of q x the GQA group, at least 16)
Q_BLOCK = 128
_COMPILED: dict[str, Callable[..., Any]] = {}  # device type -> flex_attention, compiled once per process


def flex_available() -> bool:
    """Whether this torch has FlexAttention with `BlockMask.from_kv_blocks` (torch >= 2.5)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


@dataclass
class PagedDecode:
    """One step's decode group as FlexAttention reads it; built once per step, shared by all layers.

    B rows (one per decoding request, perhaps padded to a batch bucket), q_max queries each, NB cache blocks."""

    num_blocks: torch.Tensor  # [B] int32 blocks each request holds (0 for a padding row)
    block_tables: torch.Tensor  # [B, b_max] int32 physical blocks, padded with the request's last block
    query_pos: torch.Tensor  # [B, q_max] int64 position of each query (-1: a padding query, sees nothing)
    block_size: int
    masks: dict[int | None, Any] = field(default_factory=dict)  # BlockMask per sliding window, built on first use

    def block_mask(self, cache_blocks: int, window: int | None) -> Any:
        """The `BlockMask` over a cache of `cache_blocks` blocks for `window` (built once per step and window)."""
        mask = self.masks.get(window)
        if mask is None:
            mask = self._build(cache_blocks, window)
            self.masks[window] = mask
        return mask

    def _build(self, cache_blocks: int, window: int | None) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        B, b_max = self.block_tables.shape
        q_max = self.query_pos.shape[1]
        dev = self.block_tables.device
        logical = torch.arange(b_max, device=dev, dtype=torch.int32).expand(B, b_max)
        logical = torch.minimum(logical, (self.num_blocks - 1).clamp(min=0).unsqueeze(1))  # the padding repeats the last
        block_logical = torch.full((B, cache_blocks), -1, dtype=torch.int32, device=dev)
        block_logical.scatter_(1, self.block_tables.long(), logical)  # [B, NB]
        kv_indices = torch.zeros(B, 1, 1, cache_blocks, dtype=torch.int32, device=dev)  # [B, 1, q_blocks, NB]
        kv_indices[:, 0, 0, :b_max] = self.block_tables
        mask_mod = paged_mask_mod(block_logical, self.query_pos, self.block_size, window)
        return BlockMask.from_kv_blocks(
            self.num_blocks.view(B, 1, 1), kv_indices, BLOCK_SIZE=(Q_BLOCK, self.block_size),
            mask_mod=mask_mod, seq_lengths=(q_max, cache_blocks * self.block_size), compute_q_blocks=False,
        )


def paged_mask_mod(
    block_logical: torch.Tensor, query_pos: torch.Tensor, block_size: int, window: int | None
) -> Callable[..., torch.Tensor]:
    """mask_mod(b, h, q, kv): key slot kv (of the whole cache) is visible to query q of request b iff its block is
    the request's and its position is at or before the query's (and after query - window)."""

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        logical = block_logical[b, kv // block_size]
        key_pos = logical * block_size + kv % block_size
        qp = query_pos[b, q]
        seen = (logical >= 0) & (key_pos <= qp)
        if window is not None:
            seen = seen & (key_pos > qp - window)
        return seen

    return visible


def build_paged_decode(
    tables: np.ndarray, counts: np.ndarray, query_pos: np.ndarray, block_size: int,
    to_dev: Callable[[torch.Tensor], torch.Tensor],
) -> PagedDecode:
    """The paged view of a decode group: `tables` [B, b_max] each request's blocks padded with its last one,
    `counts` [B] the blocks it holds, `query_pos` [B, q_max] its queries' positions."""
    return PagedDecode(to_dev(torch.from_numpy(counts.astype(np.int32))),
                       to_dev(torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32))),
                       to_dev(torch.from_numpy(np.ascontiguousarray(query_pos, dtype=np.int64))), block_size)


def compile_mode() -> bool | None:
    """torch.compile's `dynamic` for FlexAttention on CUDA, from TANDEM_FLEX_COMPILE: "auto" (the default: the
    first shape compiled static, which picks the decoding kernel for it, later shapes one dynamic compile),
    "static" (a compile per batch bucket and q: the decoding kernel everywhere, more compile time) or "dynamic"."""
    return {"static": False, "dynamic": True}.get(os.environ.get("TANDEM_FLEX_COMPILE", "auto"))


def _flex_attention(device_type: str) -> Callable[..., Any]:
    """flex_attention compiled for CUDA, eager elsewhere."""
    fn = _COMPILED.get(device_type)
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        if device_type == "cuda":
            _raise_recompile_limit(64)  # a shape per batch bucket and q, and the models of the device check
            fn = torch.compile(flex_attention, dynamic=compile_mode())
        else:
            fn = flex_attention
        _COMPILED[device_type] = fn
    return fn


def kernel_options(block_size: int) -> dict[str, int]:
    """The key tile of the compiled kernels must divide the sparse block (one cache block): the decoding kernel clamps
    its own, the general one (dynamic batch shapes) does not and would find no valid tile for blocks under 64."""
    return {"BLOCK_N": min(block_size, 64)}


def _raise_recompile_limit(n: int) -> None:
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, the older one
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(n, getattr(torch._dynamo.config, name)))
            return


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, paged: PagedDecode, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [B * q_max, H, D] (padded queries) over the paged cache [2, KVH, NB, BS, D] -> [B * q_max, H, D] in q's dtype."""
    _, KVH, NB, BS, D = kv_cache.shape
    B, q_max = paged.query_pos.shape
    H = q.shape[1]
    qs = q.view(B, q_max, H, D).transpose(1, 2).to(kv_cache.dtype)  # [B, H, q_max, D]
    keys = kv_cache[0].view(1, KVH, NB * BS, D)  # the whole cache as one sequence (a view)
    values = kv_cache[1].view(1, KVH, NB * BS, D)
    mask = paged.block_mask(NB, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused: known, only tests run it
        o = _flex_attention(q.device.type)(qs, keys, values, block_mask=mask, scale=scale, enable_gqa=H != KVH,
                                           kernel_options=kernel_options(BS))
    return o.transpose(1, 2).reshape(B * q_max, H, D).to(q.dtype)
