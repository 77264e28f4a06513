"""A decoder's decode and verify steps in one C++ call (`csrc/decode_stack.cpp`), where its layers run on tandem's
CPU kernels.

A decode step of a small model on a CPU spends a large share of its time between kernels: each projection call
converts its argument lists (~5 us), each layer operation is a Python dispatch (~3 us), and SmolLM2-135M makes 270
such calls a step over 30 layers (~1.5 ms of ~6 ms at batch 1 on two AVX-512 cores). `DecodeStack` holds the layers'
weights (the projections' own packed tensors, shared) and calls the same kernels in the same order from C++, so its
hidden states are bit-identical to `LlamaModel.forward`'s Python loop. Prefill steps keep the Python loop (their
attention is not the paged decode kernel). Built only when every part has a C++ kernel call: the fused CPU operations,
quantized or bf16-GEMM projections, dense MLPs or mixtures of experts run by the MoE kernels (`moe_route`, one
`quant_grouped` for the chosen experts' gate / ups and one for their downs, `moe_combine`: Qwen3-MoE, Mixtral, gpt-oss
with its biases and clamped SwiGLU; not experts across a bus), one tensor-parallel rank; `TANDEM_DECODE_STACK=0` (or
off / false) turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tandem.layers.attention import AttentionMetadata
from tandem.layers.linear import Projection, StackEntry
from tandem.layers.moe import MoeStackEntry
from tandem.layers.ops import LayerOps

ENV = "TANDEM_DECODE_STACK"
logger = logging.getLogger(__name__)


class StackMoe(Protocol):
    """A mixture-of-experts MLP as the stack sees it (`MoeMlp`, `HostExperts`)."""

    def stack_entry(self) -> MoeStackEntry | None: ...


class StackLayer(Protocol):
    """What a decoder layer offers the stack (`models/llama.py: _Layer`)."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection | None
    down: Projection | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    sinks: torch.Tensor | None

    @property
    def moe(self) -> StackMoe | None: ...


class DecodeStack:
    """Runs every layer of a decode or verify step and the final norm as one call (module doc)."""

    def __init__(self, stack: Any) -> None:
        self._stack = stack  # torch.classes.tandem.DecodeStack (a ScriptObject: its methods are not typed)

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] float32 embedded tokens (the residual stream, updated in place) -> final hidden [T, hidden]
        in the model dtype; writes the step's K / V into `kv_caches`. `meta` must hold decode rows only."""
        decode = meta.decode
        assert decode is not None and not meta.prefills, "the decode stack runs decode and verify steps only"
        return self._stack.forward(x, kv_caches, meta.positions, meta.slot_mapping, decode.seq_info, decode.block_tables)

    @staticmethod
    def accepts(meta: AttentionMetadata) -> bool:
        """Whether a step is one the stack runs: decode (or verify) rows only."""
        return meta.decode is not None and not meta.prefills


def build_decode_stack(
    layers: Sequence[StackLayer], windows: Sequence[int | None], norm: torch.Tensor, ops: LayerOps, *,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float, dtype: torch.dtype,
) -> DecodeStack | None:
    """A `DecodeStack` over `layers`, or None when some part has no C++ kernel call (or the stack is turned off)."""
    tables = ops.decode_stack_tables()
    if tables is None or not stack_wanted() or not layers:
        return None
    entries = [_entries(layer) for layer in layers]
    if any(e is None for e in entries):
        return None
    cos, sin, silu_rows = tables
    dtype_name = str(dtype).removeprefix("torch.")
    stack = torch.classes.tandem.DecodeStack(num_heads, num_kv_heads, head_dim, eps, scale, dtype_name, cos, sin, silu_rows)
    ids: dict[int, int] = {}  # a projection shared by layers is added once

    def add(p: Projection, entry: StackEntry) -> int:
        if id(p) not in ids:
            ids[id(p)] = stack.add_projection(entry.kind, entry.packed, entry.formats, entry.ns, entry.bias, entry.isa,
                                              entry.amx_rows)
        return ids[id(p)]

    for layer, found, window in zip(layers, entries, windows, strict=True):
        assert found is not None
        projections, moe = found
        qkv, o, *mlp = (add(p, e) for p, e in projections)
        gate_up, down = mlp if mlp else (-1, -1)
        stack.add_layer(layer.input_norm, qkv, layer.q_norm, layer.k_norm, o, layer.post_norm, gate_up, down, window or 0,
                        layer.sinks, _add_moe(stack, moe) if moe is not None else -1)
    stack.set_norm(norm)
    return DecodeStack(stack)


def _add_moe(stack: Any, moe: MoeStackEntry) -> int:
    """The layer's router and experts into the stack; returns its id there."""
    moe_id: int = stack.add_moe(moe.router_weight, moe.router_bias, moe.top_k, moe.renormalize, moe.softmax_after_topk,
                                moe.isa, moe.amx_rows, moe.activation, moe.alpha, moe.limit)
    for gu, dn in zip(moe.gate_ups, moe.downs, strict=True):
        stack.add_expert(moe_id, list(gu.packed), list(gu.formats), list(gu.ns), [b for b in gu.biases if b is not None],
                         list(dn.packed), list(dn.formats), list(dn.ns), [b for b in dn.biases if b is not None])
    return moe_id


def stack_wanted() -> bool:
    """`TANDEM_DECODE_STACK`: 1 / on / true (the default) or 0 / off / false; anything else is named in a warning and
    leaves the stack on."""
    wanted = os.environ.get(ENV, "1").strip().lower()
    if wanted not in ("1", "on", "true", "0", "off", "false"):
        logger.warning("%s=%r is not one of 1, on, true, 0, off, false: the decode stack stays on", ENV, wanted)
    return wanted not in ("0", "off", "false")


_LayerEntries = tuple[list[tuple[Projection, StackEntry]], MoeStackEntry | None]


def _entries(layer: StackLayer) -> _LayerEntries | None:
    """The layer's projections as kernel calls (qkv, o, then a dense MLP's gate_up and down) and its experts', or None
    when one of them has none."""
    moe = layer.moe.stack_entry() if layer.moe is not None else None
    if layer.moe is not None and moe is None:
        return None
    mlp = (layer.gate_up, layer.down) if moe is None else ()
    if any(p is None for p in mlp):
        return None
    found = [(p, p.stack_entry()) for p in (layer.qkv, layer.o, *mlp) if p is not None]
    if any(e is None for _, e in found):
        return None
    return [(p, e) for p, e in found if e is not None], moe
