"""The Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM/SmolLM2, Qwen2/2.5, Qwen3), switched by config.

Weights are fused at load time (q/k/v -> one projection, gate/up -> one) and held as plain tensors and linear
functions, not `nn.Module`s: the per-layer loop is one Python function with no module dispatch or hooks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import ConfigError, ModelConfig
from tandem.layers.attention import AttentionMetadata
from tandem.layers.linear import LinearFn, make_linear
from tandem.layers.ops import LayerOps, select_ops


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearFn  # [T, hidden] -> [T, (H + 2 * KVH) * D]
    o: LinearFn  # [T, H * D] -> [T, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearFn  # [T, hidden] -> [T, 2 * I]
    down: LinearFn  # [T, I] -> [T, hidden]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None


def _maybe(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D / 2] of rotary embeddings, with Llama 3 / linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = dict(cfg.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(rs["factor"])).float()
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled).float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class LlamaModel:
    """Forward over a flattened batch: tokens [T] -> hidden [T, hidden], K/V written to the paged cache."""

    def __init__(
        self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        use_kernels: bool = True,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # matrices in the model dtype; 1-D norm weights in float32 (they scale the float32 residual stream)
        w = {k: v.to(device=device, dtype=torch.float32 if k.endswith("norm.weight") else dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [V, hidden]
        self.norm = w["model.norm.weight"]
        head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.use_kernels = use_kernels
        self.lm_head = make_linear(head, use_kernels=use_kernels)
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]  # sliding-window attention per layer
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))  # [max_pos, D / 2]
        self.ops: LayerOps = select_ops(device, freqs.cos(), freqs.sin(), dtype, use_kernels)

    def _layer(self, w: Mapping[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_w = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        qkv_b = None
        if self.cfg.attention_bias or (a + "q_proj.bias") in w:
            qkv_b = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        m = p + "mlp."
        gate_up = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=make_linear(qkv_w, qkv_b, use_kernels=self.use_kernels),
            o=make_linear(w[a + "o_proj.weight"], w.get(a + "o_proj.bias"), use_kernels=self.use_kernels),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=make_linear(gate_up, use_kernels=self.use_kernels),
            down=make_linear(w[m + "down_proj.weight"], use_kernels=self.use_kernels),
            q_norm=_maybe(w.get(a + "q_norm.weight"), self.dtype),  # q / k stay in the model dtype
            k_norm=_maybe(w.get(a + "k_norm.weight"), self.dtype),
        )

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]; writes this step's K/V into `kv_caches` (one per layer)."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = input_ids.shape[0]
        rope = ops.rope_tables(meta.positions)
        dt = self.dtype
        # the residual stream x stays float32 (norm weights too); each layer's output is added into it by the next norm
        x = F.embedding(input_ids, self.embed).float()  # [T, hidden]
        delta: torch.Tensor | None = None
        for layer, kv_cache, window in zip(self.layers, kv_caches, self.windows):
            h = ops.add_rms_norm(x, delta, layer.input_norm, eps, dt)
            qkv = layer.qkv(h)  # [T, (H + 2 KVH) D]
            qk = qkv[:, : self.q_size + self.kv_size].view(T, H + KVH, D)
            v = qkv[:, self.q_size + self.kv_size :].view(T, KVH, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat(
                    [F.rms_norm(qk[:, :H], (D,), layer.q_norm, eps), F.rms_norm(qk[:, H:], (D,), layer.k_norm, eps)], dim=1
                )
            qk = ops.rope_write_kv(qk, v, rope, kv_cache, meta, H)  # [T, H + KVH, D], k and v now in the cache
            attn = ops.attention(qk, v, kv_cache, meta, H, self.scale, dt, window)  # [T, H D]
            h = ops.add_rms_norm(x, layer.o(attn), layer.post_norm, eps, dt)
            delta = layer.down(ops.silu_mul(layer.gate_up(h)))  # [T, hidden]
        return ops.add_rms_norm(x, delta, self.norm, eps, dt)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in float32."""
        return self.lm_head(hidden).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer: [2 (K, V), kv_heads, num_blocks, block_size, head_dim]."""
        return (2, self.cfg.num_kv_heads, num_blocks, block_size, self.cfg.head_dim)
