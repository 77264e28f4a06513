"""Attention over the paged KV cache.

One layer's KV cache is `[2, num_kv_heads, num_blocks, block_size, head_dim]` (slot = block * block_size + offset):
gathering a request's keys is one `index_select` of whole blocks (contiguous block_size x head_dim runs) and lands
directly in the [heads, tokens, dim] layout the matmuls want. Every step the runner builds one `AttentionMetadata` (index tensors only, computed once and shared by
all layers) that splits the flattened batch into
  * one *decode group*: requests with few new tokens (decode, speculative verification), padded to [B, q_max]
    queries against [B, L] gathered keys (L = the longest request's blocks * block_size), one batched matmul, and
  * one *prefill* entry per request with a longer chunk: SDPA over the chunk itself (nothing cached before it) or
    over keys gathered from its blocks.
These torch paths keep a float32 cache on the CPU (the decode group runs as two float32 matmuls); tandem's CPU
kernels (`ops.py`) read a cache in the model dtype and do the same float32 math without the gather. On CUDA the
decode group reads the paged cache with FlexAttention (`paged_decode.py`: no key gather, no float mask; the
gathered SDPA path stays as the fallback, `TANDEM_DECODE_ATTENTION=gather`).

Attention sinks (gpt-oss): a learned logit per query head joins each softmax's denominator with no value, so every
query's weights sum to less than one. Prefill SDPA gets them as one more key (zeros, with a zero value) whose logit the
additive mask sets to the head's sink; the gathered decode group appends them as a column of its scores; tandem's CPU
decode kernel adds each head's sink to its softmax's denominator. FlexAttention decode has none: on the torch
operations a model with sinks takes the gathered decode path (`ops.select_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tandem.core.plan import StepPlan
from tandem.core.plan_arrays import PlanRows, plan_rows, query_positions, slot_mapping
from tandem.layers.paged_decode import PagedDecode, build_paged_decode, paged_decode_attention

DECODE_MAX_QUERY = 16  # requests with at most this many new tokens join the padded decode group


@dataclass
class PrefillSeq:
    token_slice: slice  # rows of the flattened batch
    start_pos: int  # tokens already in the cache before this chunk
    key_blocks: torch.Tensor | None  # [nb] blocks holding its keys (None when start_pos == 0)


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B * q_max] rows of the flattened batch (padding repeats a request's last row)
    key_blocks: torch.Tensor  # [B * blocks_max] each request's blocks, padded with its last block
    bias: torch.Tensor  # [B, 1, q_max, 1, L] float32: 0 where the query may attend, -inf elsewhere
    batch: int
    q_max: int
    key_len: int
    flat_index: torch.Tensor  # [n_valid] positions in the padded [B * q_max] layout of the real tokens, in row order
    out_rows: torch.Tensor  # [n_valid] rows of the flattened batch they belong to
    seq_info: torch.Tensor  # [B, 3] int64 (first row, new tokens n, tokens cached before them): the CPU kernel's view
    block_tables: torch.Tensor  # [B, blocks_max] int64, each request's blocks padded with its last one
    dense: bool = False  # every token of the step is here, q_max per request, in order: no gather / scatter
    query_pos: torch.Tensor | None = None  # [B, q_max] int64 position of each padded query (torch path)
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # `bias` narrowed to a sliding window, per window
    paged: PagedDecode | None = None  # set: keys read from the paged cache by FlexAttention (no key gather, no bias)


@dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, the slot where each token's K/V goes
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeGroup | None = None


def build_metadata(
    plan: StepPlan, block_size: int, device: torch.device, pin: bool = False, gathered_decode: bool = True,
    paged_decode: bool = False, rows: PlanRows | None = None,
) -> AttentionMetadata:
    """Index tensors for one step, built on the CPU from the plan and copied to `device` in one go each.

    `gathered_decode=False` (tandem's CPU kernels, which read `seq_info` / `block_tables` only) skips the padded
    gather indices and the [B, q_max, L] mask of the torch decode path, ~0.5 ms per step at 32 requests.
    `paged_decode=True` (FlexAttention over the paged cache, `paged_decode.py`) keeps the query indices but builds
    block tables and query positions instead of the key gather and the mask. Vectorised over the rows
    (core/plan_arrays.py; `rows`: the plan's, when already read): the launch waits for this."""
    rows = rows if rows is not None else plan_rows(plan.requests, block_size)
    to_dev = _mover(device, pin)
    fast = _paged_step(rows, block_size, to_dev) if paged_decode and not gathered_decode else None
    if fast is not None:
        return fast[0]
    used = rows.used  # [B]
    tables = rows.tables(int(used.max(initial=1)))  # [B, W]
    positions = rows.positions()  # [T]
    slots = slot_mapping(tables, rows.row_of_tokens(), positions, block_size)  # [T]
    meta = AttentionMetadata(rows.num_tokens, to_dev(_long(positions)), to_dev(_long(slots)))
    offsets = rows.offsets
    decode = (rows.counts <= DECODE_MAX_QUERY) & (rows.starts > 0)  # [B]
    for i in np.flatnonzero(~decode).tolist():
        row0, n, start = int(offsets[i]), int(rows.counts[i]), int(rows.starts[i])
        key_blocks = to_dev(_long(tables[i, : used[i]])) if start > 0 else None
        meta.prefills.append(PrefillSeq(slice(row0, row0 + n), start, key_blocks))
    picked = np.flatnonzero(decode)
    if len(picked):
        group = _DecodeRows(rows.starts[picked], rows.counts[picked], offsets[picked], tables[picked], used[picked])
        meta.decode = _decode_group(group, block_size, to_dev, gathered_decode, paged_decode)
        meta.decode.dense = not meta.prefills and bool((group.counts == meta.decode.q_max).all())
    return meta


@dataclass(frozen=True)
class _DecodeRows:
    """The decode group's rows: first positions, new tokens, first flat rows [B]; blocks [B, >= max(used)] padded
    with each one's last used block; the blocks each reaches [B]."""

    starts: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    tables: np.ndarray
    used: np.ndarray


def step_inputs(
    plan: StepPlan, block_size: int, device: torch.device, pin: bool = False, gathered_decode: bool = True,
    paged_decode: bool = False, rows: PlanRows | None = None,
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A forward's inputs on `device`: token ids [T], the attention metadata (`build_metadata`) and the rows of
    the flattened batch whose logits are wanted [R] (`rows`: the plan's arrays, when already read)."""
    rows = rows if rows is not None else plan_rows(plan.requests, block_size)
    fast = _paged_step(rows, block_size, _mover(device, pin)) if paged_decode and not gathered_decode else None
    if fast is not None:
        return host_ids(rows.input_ids, device, pin), fast[0], fast[1]
    wanted = _long(rows.logits_rows())
    if pin and device.type == "cuda":
        wanted = wanted.pin_memory()
    meta = build_metadata(plan, block_size, device, pin, gathered_decode, paged_decode, rows)
    return host_ids(rows.input_ids, device, pin), meta, wanted.to(device, non_blocking=True)


def host_ids(ids: np.ndarray, device: torch.device, pin: bool = True) -> torch.Tensor:
    """Token ids [T] on `device` (copied from page-locked memory on CUDA when `pin`)."""
    return _mover(device, pin)(_long(ids))


def _mover(device: torch.device, pin: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Copies a host tensor to `device` (from page-locked memory on CUDA when `pin`); on the CPU the tensor itself,
    without a call into torch (`t.to("cpu")` returns `t`, but ten such calls cost a launch 0.02 ms after the host's
    sampling had flushed the caches: AMD EPYC Zen 4, 2026-12-06)."""
    if device.type == "cpu":
        return _same

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        if pin and device.type == "cuda":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return to_dev


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _step_op() -> Callable[..., list[torch.Tensor]] | None:
    """tandem's one-call builder of a step's paged inputs (csrc/plan_ops.cpp), when its op library is loaded."""
    try:
        return torch.ops.tandem.step_inputs  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _paged_step(rows: PlanRows, block_size: int,
                to_dev: Callable[[torch.Tensor], torch.Tensor]) -> tuple[AttentionMetadata, torch.Tensor] | None:
    """The metadata and logits rows [R] of a step on the paged path, in one call of the op library (equal to
    `build_metadata`'s NumPy expressions, ~100 calls: csrc/plan_ops.cpp); None when the library is not loaded."""
    op = _step_op()
    if op is None:
        return None
    out = op(*map(torch.from_numpy, (rows.starts, rows.counts, rows.wanted, rows.used, rows.blocks)), block_size,
             DECODE_MAX_QUERY)
    return paged_metadata(rows, block_size, to_dev, out)


def paged_step_inputs(rows: PlanRows, out: Sequence[torch.Tensor], device: torch.device,
                      pin: bool = False) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`step_inputs` on the paged path from the op library's `step_inputs` outputs `out` for `rows` (computed in
    the same call as the rows themselves: csrc/plan_ops.cpp's `plan_patch_step`)."""
    to_dev = _mover(device, pin)
    meta, wanted = paged_metadata(rows, rows.block_size, to_dev, out)
    return host_ids(rows.input_ids, device, pin), meta, wanted


def paged_metadata(rows: PlanRows, block_size: int, to_dev: Callable[[torch.Tensor], torch.Tensor],
                   out: Sequence[torch.Tensor]) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata and logits rows [R] of a step on the paged path from the op library's `step_inputs` outputs."""
    positions, slots, wanted, prefill_rows, token_index, flat, out_rows, query_pos, seq_info, tables, held, tables32 = out
    meta = AttentionMetadata(rows.num_tokens, to_dev(positions), to_dev(slots))
    if len(prefill_rows):
        offsets, first = rows.offsets, np.cumsum(rows.used) - rows.used
        for i in prefill_rows.tolist():
            row0, n, start = int(offsets[i]), int(rows.counts[i]), int(rows.starts[i])
            blocks = to_dev(_long(rows.blocks[first[i] : first[i] + rows.used[i]])) if start > 0 else None
            meta.prefills.append(PrefillSeq(slice(row0, row0 + n), start, blocks))
    batch, q_max = query_pos.shape
    if batch:
        query_pos = to_dev(query_pos)
        meta.decode = DecodeGroup(
            token_index=to_dev(token_index), key_blocks=_UNUSED, bias=_UNUSED, batch=batch, q_max=q_max,
            key_len=tables.shape[1] * block_size, flat_index=to_dev(flat), out_rows=to_dev(out_rows),
            seq_info=seq_info, block_tables=tables, query_pos=query_pos,
            dense=not meta.prefills and flat.shape[0] == batch * q_max,
            paged=PagedDecode(to_dev(held), to_dev(tables32), query_pos, block_size),
        )
    return meta, to_dev(wanted)


def _long(a: np.ndarray) -> torch.Tensor:
    """An int64 CPU tensor of `a` (its own memory)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


_UNUSED = torch.empty(0, dtype=torch.long)  # stands for the torch-path fields when the CPU kernels do not read them


def _decode_group(
    rows: _DecodeRows, block_size: int, to_dev: Callable[[torch.Tensor], torch.Tensor], gathered: bool = True,
    paged: bool = False,
) -> DecodeGroup:
    """The decode group's index tensors: CPU kernels' view only, plus the gathered or the paged path's."""
    tables, used = rows.tables, rows.used
    q_max = int(rows.counts.max())
    b_max = int(used.max())
    L = b_max * block_size
    B = len(used)
    block_tables = _long(tables[:, :b_max])  # [B, b_max]
    seq_info = _long(np.stack([rows.offsets, rows.counts, rows.starts], axis=1))  # [B, 3]
    if not gathered and not paged:
        return DecodeGroup(
            token_index=_UNUSED, key_blocks=_UNUSED, bias=_UNUSED, batch=B, q_max=q_max, key_len=L,
            flat_index=_UNUSED, out_rows=_UNUSED, seq_info=seq_info, block_tables=block_tables,
        )
    limits = query_positions(rows.starts, rows.counts, q_max)  # [B, q_max]: query j sees keys [0, start + j]
    token_index = query_positions(rows.offsets, rows.counts, q_max).reshape(-1)  # padding repeats the last row
    real = np.arange(q_max, dtype=np.int64)[None, :] < rows.counts[:, None]  # [B, q_max]
    flat = np.flatnonzero(real.reshape(-1))
    out_rows = (rows.offsets[:, None] + np.arange(q_max, dtype=np.int64)[None, :])[real]
    query_pos = _long(limits)  # [B, q_max]
    if paged:
        return DecodeGroup(
            token_index=to_dev(_long(token_index)), key_blocks=_UNUSED, bias=_UNUSED, batch=B, q_max=q_max,
            key_len=L, flat_index=to_dev(_long(flat)), out_rows=to_dev(_long(out_rows)),
            seq_info=seq_info, block_tables=block_tables, query_pos=to_dev(query_pos),
            paged=build_paged_decode(tables[:, :b_max], used, limits, block_size, to_dev),
        )
    allowed = torch.arange(L)[None, None, :] <= query_pos[:, :, None]  # [B, q_max, L]
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return DecodeGroup(
        token_index=to_dev(_long(token_index)),
        key_blocks=to_dev(block_tables.view(-1)),
        bias=to_dev(bias.view(B, 1, q_max, 1, L)),
        batch=B,
        q_max=q_max,
        key_len=L,
        flat_index=to_dev(_long(flat)),
        out_rows=to_dev(_long(out_rows)),
        seq_info=seq_info,
        block_tables=block_tables,
        query_pos=to_dev(query_pos),
    )


def window_mask(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[..., num_keys] bool: key position j is visible to a query at position p iff j <= p and, with a sliding
    window W, j > p - W (the query and the W - 1 keys before it, as transformers' Mistral / Qwen2 masks)."""
    keys = torch.arange(num_keys, device=query_pos.device)
    p = query_pos.unsqueeze(-1)
    visible = keys <= p
    if window is not None:
        visible &= keys > p - window
    return visible


def _windowed_bias(g: DecodeGroup, window: int | None) -> torch.Tensor:
    """The decode group's additive mask [B, 1, q_max, 1, L], narrowed to `window` (built once per step and window)."""
    if window is None:
        return g.bias
    bias = g.window_bias.get(window)
    if bias is None:
        assert g.query_pos is not None
        hidden = ~window_mask(g.query_pos, g.key_len, window)  # [B, q_max, L]
        bias = torch.zeros(g.bias.shape, device=g.bias.device).masked_fill_(hidden.view(g.bias.shape), float("-inf"))
        g.window_bias[window] = bias
    return bias


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V: kv_cache [2, KVH, num_blocks, block_size, D]; k, v [T, KVH, D]."""
    dt = kv_cache.dtype
    flat = kv_cache.flatten(2, 3)  # [2, KVH, num_slots, D] (a view)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(dt))
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1).to(dt))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over everything cached for their requests (the last `window` keys
    of each query's position with a sliding window; `sinks` [H] float32: each head's sink logit).

    q [T, H, D]; k, v [T, KVH, D] (already written to `kv_cache`); returns [T, H * D] in q's dtype.
    """
    T, H, D = q.shape
    g = meta.decode
    if g is not None and g.dense:
        return _decode_attention(q, kv_cache, g, scale, window, sinks).view(T, H * D)
    out = torch.empty_like(q)
    for p in meta.prefills:
        s = p.token_slice
        out[s] = prefill_attention(q[s], k[s], v[s], kv_cache, p, scale, window=window, sinks=sinks)
    if g is not None:
        o = _decode_attention(q, kv_cache, g, scale, window, sinks)  # [B * q_max, H, D]
        out[g.out_rows] = o.index_select(0, g.flat_index)
    return out.view(T, H * D)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, p: PrefillSeq, scale: float,
    k_transposed: bool = False, window: int | None = None, math_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's chunk: q [n, H, D] -> [n, H, D]. `k_transposed`: the cache's K blocks are [D, block_size]
    (tandem's CPU kernels), not [block_size, D]. `window`: each query sees only the last `window` keys.
    `math_dtype`: the dtype SDPA runs in (default float32 on the CPU, the cache's on an accelerator).
    `sinks` [H]: each head's sink logit in the softmax's denominator."""
    n = q.shape[0]
    positions = torch.arange(p.start_pos, p.start_pos + n, device=q.device)
    # the math runs in one dtype on every path and reads K/V as the cache holds them, so a prefix-cache hit changes
    # nothing
    dt = math_dtype or (torch.float32 if kv_cache.device.type == "cpu" else kv_cache.dtype)
    qh = q.transpose(0, 1).unsqueeze(0).to(dt)  # [1, H, n, D]
    if sinks is not None:
        keys, values = (k, v) if p.key_blocks is None else _cached_kv(kv_cache, p, k_transposed, n)
        visible = window_mask(positions, keys.shape[0], window)  # [n, L]
        o = _sink_attention(qh, keys.to(dt), values.to(dt), visible, sinks, scale)
        return o[0].transpose(0, 1).to(q.dtype)
    if p.key_blocks is None:
        o = F.scaled_dot_product_attention(
            qh, k.transpose(0, 1).unsqueeze(0).to(dt), v.transpose(0, 1).unsqueeze(0).to(dt),
            attn_mask=window_mask(positions, n, window) if window is not None and window < n else None,
            is_causal=window is None or window >= n, scale=scale, enable_gqa=True,
        )
        return o[0].transpose(0, 1).to(q.dtype)
    total = p.start_pos + n
    kv = kv_cache.index_select(2, p.key_blocks)  # [2, KVH, nb, BS, D]
    if k_transposed:
        _, KVH, nb, BS, D = kv.shape
        kv = torch.stack([kv[0].view(KVH, nb, D, BS).transpose(-1, -2), kv[1]])
    kv = kv.flatten(2, 3)[:, :, :total].to(dt)  # [2, KVH, total, D]
    # query i (position start + i) sees keys [0, start + i] (the last `window` of them with a window)
    mask = window_mask(positions, kv.shape[2], window)
    o = F.scaled_dot_product_attention(
        qh, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
    )  # [1, H, n, D]
    return o[0].transpose(0, 1).to(q.dtype)


def _cached_kv(kv_cache: torch.Tensor, p: PrefillSeq, k_transposed: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's keys and values from its blocks: K, V [start_pos + n, KVH, D] in the cache's dtype."""
    assert p.key_blocks is not None
    kv = kv_cache.index_select(2, p.key_blocks)  # [2, KVH, nb, BS, D]
    if k_transposed:
        _, KVH, nb, BS, D = kv.shape
        kv = torch.stack([kv[0].view(KVH, nb, D, BS).transpose(-1, -2), kv[1]])
    kv = kv.flatten(2, 3)[:, :, : p.start_pos + n].transpose(1, 2)  # [2, total, KVH, D]
    return kv[0], kv[1]


def _sink_attention(
    qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with sinks: qh [1, H, n, D]; k, v [L, KVH, D]; visible [n, L] bool; sinks [H] -> [1, H, n, D]. The sink
    is one more key of zeros (logit 0) with a zero value, its logit raised to the head's sink by the additive mask."""
    _, H, n, _ = qh.shape
    L = k.shape[0]
    zero = k.new_zeros(1, *k.shape[1:])
    keys = torch.cat([k, zero]).transpose(0, 1).unsqueeze(0)  # [1, KVH, L + 1, D]
    values = torch.cat([v, zero]).transpose(0, 1).unsqueeze(0)
    bias = torch.zeros(n, L, dtype=qh.dtype, device=qh.device).masked_fill_(~visible, float("-inf"))
    mask = torch.cat([bias.expand(H, n, L), sinks.to(qh.dtype).view(H, 1, 1).expand(H, n, 1)], dim=-1)
    return F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask.unsqueeze(0), scale=scale, enable_gqa=True)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim with one more logit per row, `sinks` (broadcast to scores[..., :1]), then dropped."""
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup, scale: float, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Few queries per request against its gathered keys, all requests at once -> [B * q_max, H, D].

    Heads are grouped (GQA): query head h reads kv head h // G, G = H / KVH. With batch dims (KVH, B) the gathered
    keys need no copy: scores [KVH, B, q_max * G, L] = q @ k^T, in the cache's dtype (float32 on the CPU).
    """
    B, q_max, L = g.batch, g.q_max, g.key_len
    _, H, D = q.shape
    KVH = kv_cache.shape[1]
    G = H // KVH
    qb = q if g.dense else q.index_select(0, g.token_index)  # [B * q_max, H, D]
    if g.paged is not None:
        if sinks is not None:
            raise ValueError("attention sinks need the gathered decode path (LayerOps.use_gathered_decode)")
        return paged_decode_attention(qb, kv_cache, g.paged, scale, window)
    kv = kv_cache.index_select(2, g.key_blocks).view(2, KVH, B, L, D)
    if q.is_cuda and sinks is None:
        qs = qb.view(B, q_max, H, D).transpose(1, 2)  # [B, H, q_max, D]
        keys = kv[0].transpose(0, 1)  # [B, KVH, L, D]
        mask = _windowed_bias(g, window).view(B, 1, q_max, L)
        o = F.scaled_dot_product_attention(qs, keys, kv[1].transpose(0, 1), attn_mask=mask.to(qs.dtype), scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * q_max, H, D)
    qs = qb.view(B, q_max, KVH, G, D).permute(2, 0, 1, 3, 4).reshape(KVH, B, q_max * G, D).to(kv.dtype)
    scores = torch.matmul(qs, kv[0].transpose(-1, -2)).mul_(scale)  # [KVH, B, q_max * G, L]
    scores.view(KVH, B, q_max, G, L).add_(_windowed_bias(g, window).view(1, B, q_max, 1, L))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # query head kvh * G + g: its sink broadcast over the batch and the queries
        probs = _softmax_with_sinks(scores.view(KVH, B, q_max, G, L), sinks.view(KVH, 1, 1, G, 1)).view(scores.shape)
    o = torch.matmul(probs, kv[1])  # [KVH, B, q_max * G, D]
    return o.view(KVH, B, q_max, G, D).permute(1, 2, 0, 3, 4).reshape(B * q_max, H, D).to(q.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
