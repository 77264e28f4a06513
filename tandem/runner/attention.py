"""Attention over the paged KV cache.

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`. Every step the runner builds one
`AttentionMetadata` (index tensors only, computed once and shared by all layers) that splits the flattened batch into
  * one *decode group*: requests with few new tokens (decode, speculative verification), padded to
    [B, q_max] queries against [B, blocks_max * block_size] gathered keys, and
  * one *prefill* entry per request with a longer chunk (its own causal attention, keys gathered from its blocks, or
    taken directly from the chunk when nothing is cached before it).
A fused paged kernel (flash-attn) is used on CUDA when that package is installed; otherwise torch SDPA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.core.plan import StepPlan

DECODE_MAX_QUERY = 16  # requests with at most this many new tokens join the padded decode group

try:  # optional fused kernel, CUDA only
    from flash_attn import flash_attn_with_kvcache as _flash_with_kvcache  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _flash_with_kvcache = None


@dataclass
class PrefillSeq:
    token_slice: slice  # rows of the flattened batch
    start_pos: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # [num_blocks_used] (None when start_pos == 0: keys come from the chunk itself)


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B, q_max] rows of the flattened batch (padding points at row 0)
    valid: torch.Tensor  # [B, q_max] bool, real query positions
    block_tables: torch.Tensor  # [B, blocks_max]
    bias: torch.Tensor  # [B, 1, q_max, blocks_max * block_size] float32: 0 where query may attend, -inf elsewhere
    q_max: int
    flat_index: torch.Tensor  # [n_valid] positions in the padded [B * q_max] layout of the real tokens, in row order
    out_rows: torch.Tensor  # [n_valid] rows of the flattened batch they belong to
    seq_lens: torch.Tensor  # [B] int32 total keys per request (flash-attn)
    dense: bool  # every token of the step is in this group, q_max tokens per request, in order: no gather/scatter


@dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat slot (block * block_size + offset) where each token's K/V goes
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeGroup | None = None


def build_metadata(plan: StepPlan, block_size: int, device: torch.device, pin: bool = False) -> AttentionMetadata:
    """Index tensors for one step, built on the CPU from the plan and copied to `device` in one go each."""
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[tuple[int, int, int, list[int]]] = []  # (row0, n, start, blocks)
    decodes: list[tuple[int, int, int, list[int]]] = []
    row = 0
    for r in plan.requests:
        n = r.num_tokens
        start = r.start_pos
        bt = r.block_table
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in pos)
        nblocks = (start + n + block_size - 1) // block_size
        entry = (row, n, start, bt[:nblocks])
        (decodes if n <= DECODE_MAX_QUERY and start > 0 else prefills).append(entry)
        row += n

    def to_dev(x: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.tensor(x, dtype=dtype)
        if pin and device.type == "cuda":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(num_tokens=row, positions=to_dev(positions), slot_mapping=to_dev(slots))
    for row0, n, start, blocks in prefills:
        meta.prefills.append(PrefillSeq(slice(row0, row0 + n), start, to_dev(blocks) if start > 0 else None))
    if decodes:
        meta.decode = _decode_group(decodes, block_size, to_dev, device)
        meta.decode.dense = not prefills and all(n == meta.decode.q_max for _, n, _, _ in decodes)
    return meta


def _decode_group(
    decodes: list[tuple[int, int, int, list[int]]], block_size: int, to_dev: Callable[..., torch.Tensor], device: torch.device
) -> DecodeGroup:
    q_max = max(n for _, n, _, _ in decodes)
    b_max = max(len(b) for _, _, _, b in decodes)
    kv_len = b_max * block_size
    token_index, valid, tables, flat, out_rows, seq_lens, limits = [], [], [], [], [], [], []
    for i, (row0, n, start, blocks) in enumerate(decodes):
        token_index.append([row0 + min(j, n - 1) for j in range(q_max)])
        valid.append([j < n for j in range(q_max)])
        tables.append(blocks + [blocks[-1]] * (b_max - len(blocks)))
        limits.append([start + min(j, n - 1) for j in range(q_max)])  # query j sees keys [0, start + j]
        flat.extend(i * q_max + j for j in range(n))
        out_rows.extend(range(row0, row0 + n))
        seq_lens.append(start + n)
    allowed = torch.arange(kv_len)[None, None, :] <= torch.tensor(limits)[:, :, None]  # [B, q_max, kv_len]
    bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
    return DecodeGroup(
        token_index=to_dev(token_index),
        valid=to_dev(valid, torch.bool),
        block_tables=to_dev(tables),
        bias=bias.unsqueeze(1).to(device, non_blocking=True),
        q_max=q_max,
        flat_index=to_dev(flat),
        out_rows=to_dev(out_rows),
        seq_lens=to_dev(seq_lens, torch.int32),
        dense=False,
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V: kv_cache [2, num_blocks, block_size, kv_heads, head_dim]; k, v [T, kv_heads, head_dim]."""
    kv_flat = kv_cache.view(2, -1, k.shape[1], k.shape[2])  # [2, num_slots, kv_heads, head_dim]
    kv_flat[0].index_copy_(0, slot_mapping, k)
    kv_flat[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of this step's queries over everything cached for their requests.

    q [T, H, D]; k, v [T, KVH, D] (already written to `kv_cache`); returns [T, H * D].
    """
    T, H, D = q.shape
    out = torch.empty_like(q)
    if meta.decode is not None and meta.decode.dense:
        return _decode_attention(q, kv_cache, meta.decode, scale, out).view(T, H * D)
    for p in meta.prefills:
        out[p.token_slice] = _prefill_attention(q[p.token_slice], k[p.token_slice], v[p.token_slice], kv_cache, p, scale)
    if meta.decode is not None:
        _decode_attention(q, kv_cache, meta.decode, scale, out)
    return out.view(T, H * D)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, p: PrefillSeq, scale: float
) -> torch.Tensor:
    n = q.shape[0]
    if p.block_table is None:
        keys, values = k, v  # [n, KVH, D]
        mask = None
        causal = True
    else:
        kv = kv_cache[:, p.block_table].flatten(1, 2)  # [2, blocks * block_size, KVH, D]
        total = p.start_pos + n
        keys, values = kv[0, :total], kv[1, :total]
        # query i (position start + i) sees keys [0, start + i]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=p.start_pos)
        causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, total, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, n, D]
    return o[0].transpose(0, 1)  # [n, H, D]


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Few queries per request against its gathered blocks, all requests at once.

    Heads are grouped (GQA): query head h reads kv head h // G, G = H / KVH, so the queries of one kv head form a
    [q_max * G, D] matrix and the scores are one batched matmul. Scores and softmax in float32.
    """
    B, q_max = g.token_index.shape
    T, H, D = q.shape
    KVH = kv_cache.shape[3]
    G = H // KVH
    if _flash_with_kvcache is not None and q.is_cuda and q_max == 1:
        o = _flash_with_kvcache(
            q[g.token_index], kv_cache[0], kv_cache[1], cache_seqlens=g.seq_lens, block_table=g.block_tables.int(),
            softmax_scale=scale, causal=True,
        )  # [B, 1, H, D]
        out[g.out_rows] = o.reshape(B * q_max, H, D)[g.flat_index]
        return out
    qb = q if g.dense else q.index_select(0, g.token_index.view(-1))  # [B * q_max, H, D]
    qb = qb.view(B, q_max, KVH, G, D).permute(0, 2, 1, 3, 4).reshape(B, KVH, q_max * G, D).float()
    kv = kv_cache.index_select(1, g.block_tables.view(-1))  # [2, B * blocks_max, block_size, KVH, D]
    kv = kv.view(2, B, -1, KVH, D).float()  # [2, B, L, KVH, D]
    keys = kv[0].permute(0, 2, 3, 1)  # [B, KVH, D, L]
    values = kv[1].transpose(1, 2)  # [B, KVH, L, D]
    scores = torch.matmul(qb, keys).mul_(scale)  # [B, KVH, q_max * G, L]
    scores.view(B, KVH, q_max, G, -1).add_(g.bias.view(B, 1, q_max, 1, -1))
    o = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, KVH, q_max * G, D]
    o = o.view(B, KVH, q_max, G, D).permute(0, 2, 1, 3, 4).reshape(B * q_max, H, D).to(q.dtype)
    if g.dense:
        return o
    out[g.out_rows] = o.index_select(0, g.flat_index)
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
