"""The Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM/SmolLM2, Qwen2/2.5, Qwen3, gpt-oss), switched by
config; its MLP dense, or a mixture of experts (Qwen3-MoE, Mixtral, gpt-oss: `layers/moe.py`) in the layers the config
names. gpt-oss adds attention sinks (a learned logit per query head), an o_proj bias, alternating sliding-window
layers, YaRN RoPE (its attention factor scales cos / sin) and stacked experts with biases (MXFP4 in the released
checkpoints, dequantized by the reader).

Weights are fused at load time (q/k/v -> one projection, gate/up -> one) and held as plain tensors and projections
(`layers/linear.py`), not `nn.Module`s: the per-layer loop is one Python function with no module dispatch or hooks.
The model takes its weights from the checkpoint's store one layer at a time, each projection built (packed, kept
quantized or not) before the next is read, so loading never holds more than the model plus one layer's inputs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tandem.config import ConfigError, ModelConfig
from tandem.layers.attention import AttentionMetadata
from tandem.layers.decode_stack import build_decode_stack
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import DenseProjection, Projection, Weight, make_linear
from tandem.layers.moe import Expert, GptOssMoe, MoeMlp
from tandem.layers.moe_offload import HOST, ExpertBus, HostExperts, host_silu_mul
from tandem.layers.ops import LayerOps, select_ops
from tandem.layers.parallel import TensorParallel
from tandem.layers.quant import QuantizedTensor
from tandem.models.checkpoint import WeightStore, moe_weight_names, stacked_moe_names
from tandem.models.sharding import WeightShard, slice_weight


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Projection  # [T, hidden] -> [T, (H + 2 * KVH) * D]
    o: Projection  # [T, H * D] -> [T, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Projection | None  # [T, hidden] -> [T, 2 * I] (a dense MLP)
    down: Projection | None  # [T, I] -> [T, hidden]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    moe: MoeMlp | HostExperts | None = None  # instead of gate_up / down in a mixture-of-experts layer
    sinks: torch.Tensor | None = None  # [H] float32: each head's sink logit (gpt-oss)

    @property
    def dense(self) -> bool:
        """A dense MLP (gate_up and down), not a mixture of experts."""
        return self.moe is None and self.gate_up is not None and self.down is not None

    @property
    def projections(self) -> list[Projection]:
        dense = [p for p in (self.gate_up, self.down) if p is not None]
        experts = [p for e in self.moe.experts for p in (e.gate_up, e.down)] + [self.moe.router] if self.moe else []
        return [self.qkv, self.o, *dense, *experts]


class ModelWeights:
    """The model's view of a checkpoint: matrices as it keeps them (in `dtype`, or quantized when the store keeps them
    so), vectors dense on `device` (norm weights float32: they scale the float32 residual stream; biases in `dtype`).
    With a `shard`, each tensor is this tensor-parallel rank's slice of it."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device, shard: WeightShard | None = None,
    ) -> None:
        stored = weights.stored if isinstance(weights, WeightStore) else weights.__getitem__
        self._stored = stored if shard is None else (lambda name: shard.cut(name, stored(name)))
        self.names = set(weights)
        self.dtype, self.device = dtype, device

    def matrix(self, name: str) -> Weight:
        w = self._stored(name)
        if isinstance(w, QuantizedTensor):
            return w.to(self.device) if w.device != self.device else w
        return w.to(device=self.device, dtype=self.dtype)

    def vector(self, name: str) -> torch.Tensor:
        w = self._stored(name)
        dense = w.dequantize(self.dtype) if isinstance(w, QuantizedTensor) else w
        return dense.to(device=self.device, dtype=torch.float32 if name.endswith("norm.weight") else self.dtype)

    def placed_on(self, device: torch.device) -> ModelWeights:
        """The same weights, each read onto `device` instead (an offloaded layer's router and experts: the host);
        changes nothing in this view."""
        view = copy.copy(self)
        view.device = device
        return view


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D / 2] of rotary embeddings, with Llama 3 / linear / YaRN scaling applied."""
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
    if kind == "yarn":
        return _yarn(cfg, rs)[0]
    raise ConfigError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, yarn")


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention scaling, 1 for the other kinds."""
    rs = dict(cfg.rope_scaling or {})
    return _yarn(cfg, rs)[1] if rs.get("rope_type", rs.get("type")) == "yarn" else 1.0


def _yarn(cfg: ModelConfig, rs: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [D / 2] and attention factor, as transformers' `_compute_yarn_parameters` computes
    them (float32, `truncate` true unless the config says otherwise)."""
    base, dim = cfg.rope_theta, cfg.head_dim
    original = float(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = float(rs.get("factor") or cfg.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(float(rs.get("beta_fast") or 32)), correction_dim(float(rs.get("beta_slow") or 1))
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


class LlamaModel:
    """Forward over a flattened batch: tokens [T] -> hidden [T, hidden], K/V written to the paged cache.

    With `tp` (tensor parallel, `layers/parallel.py`) the model is one rank's shard: its heads, MLP features and
    vocabulary slice; `cfg` stays the whole model's, `self.cfg` is the shard's."""

    def __init__(
        self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        use_kernels: bool = True, tp: TensorParallel | None = None, after_layer: Callable[[], None] | None = None,
        host_expert_layers: Collection[int] = (),
    ) -> None:
        """`after_layer` runs once each layer is built: the runner hands the pages of its freed temporaries back to
        the OS there (a 1.7B model's load peaked at 1.26x its final RSS with one trim at the end, 1.04x with one per
        layer). `host_expert_layers`: MoE layers whose router and experts are held and run on the host
        (`layers/moe_offload.py`)."""
        self.tp = tp or TensorParallel()
        self.vocab_size = cfg.vocab_size
        shard = WeightShard(cfg, self.tp) if self.tp.enabled else None
        cfg = self.tp.shard_config(cfg)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.use_kernels = use_kernels
        self.host_expert_layers = tuple(sorted(host_expert_layers))
        self.expert_bus = ExpertBus(device)  # what crosses between the device and the host experts, metered
        self._host_silu_mul = host_silu_mul(dtype, use_kernels) if self.host_expert_layers else None
        w = ModelWeights(weights, dtype, device, shard)
        self.norm = w.vector("model.norm.weight")
        self.lm_head, self.embed = self._head_and_embedding(w)
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            self.layers.append(self._layer(w, i))
            if after_layer is not None:
                after_layer()
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]  # sliding-window attention per layer
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))  # [max_pos, D / 2]
        a = rope_attention_factor(cfg)  # YaRN's scaling of cos / sin, in float32 before any rounding (as transformers)
        cos, sin = (freqs.cos() * a, freqs.sin() * a) if a != 1.0 else (freqs.cos(), freqs.sin())
        # attention sinks (gpt-oss) run the torch operations: the fused C++ attention kernels have none
        self.ops: LayerOps = select_ops(device, cos, sin, dtype, use_kernels, sinks=cfg.attention_sinks)
        # decode and verify steps as one C++ call where every layer runs on tandem's CPU kernels (one rank only)
        self.decode_stack = None if self.tp.enabled else build_decode_stack(
            self.layers, self.windows, self.norm, self.ops, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, scale=self.scale, dtype=dtype)

    def _head_and_embedding(self, w: ModelWeights) -> tuple[Projection, Projection]:
        """The output projection and the embedding table; tied, they share one storage when the projection can hand
        its rows back (bf16 GEMM packing, quantized blocks, plain tensors), else the table is kept beside it."""
        embed = w.matrix("model.embed_tokens.weight")  # [V, hidden]
        tied = self.cfg.tie_word_embeddings or "lm_head.weight" not in w.names
        head_weight = embed if tied else w.matrix("lm_head.weight")
        rows = self.cfg.output_rows
        if rows is not None and rows < head_weight.shape[0]:
            if self.tp.enabled:
                raise ConfigError("output_rows (a draft's restricted vocabulary) runs on one rank only")
            head_weight, tied = slice_weight(head_weight, 0, 0, rows), False  # the table keeps every row
        head = make_linear(head_weight, use_kernels=self.use_kernels, dtype=self.dtype)
        if tied and head.has_rows:
            return head, head
        return head, self._embedding_table(embed)

    def _embedding_table(self, embed: Weight) -> Projection:
        """A table only read by rows: kept quantized (packed, rows dequantized by the kernels) or dense, never packed."""
        if isinstance(embed, QuantizedTensor):
            table = make_linear(embed, use_kernels=self.use_kernels, dtype=self.dtype)
            if table.has_rows:
                return table
            embed = embed.dequantize(self.dtype)
        return DenseProjection(embed, None)

    def _layer(self, w: ModelWeights, i: int) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m = p + "mlp."
        qkv_b = o_b = None
        if self.cfg.attention_bias or (a + "q_proj.bias") in w.names:
            qkv_b = torch.cat([w.vector(a + f"{x}_proj.bias") for x in "qkv"])
        if self.cfg.output_bias or (a + "o_proj.bias") in w.names:
            o_b = w.vector(a + "o_proj.bias")
        k, dt = self.use_kernels, self.dtype
        moe = self._experts(w, i) if i in self.cfg.moe_layers else None
        return _Layer(
            input_norm=w.vector(p + "input_layernorm.weight"),
            qkv=make_linear([w.matrix(a + "q_proj.weight"), w.matrix(a + "k_proj.weight"), w.matrix(a + "v_proj.weight")], qkv_b, k, dt),
            o=make_linear(w.matrix(a + "o_proj.weight"), o_b, k, dt),
            post_norm=w.vector(p + "post_attention_layernorm.weight"),
            gate_up=None if moe else make_linear([w.matrix(m + "gate_proj.weight"), w.matrix(m + "up_proj.weight")], None, k, dt),
            down=None if moe else make_linear(w.matrix(m + "down_proj.weight"), None, k, dt),
            # q / k norms (Qwen3) in the model dtype, as q and k are
            q_norm=w.vector(a + "q_norm.weight").to(dt) if self.cfg.qk_norm else None,
            k_norm=w.vector(a + "k_norm.weight").to(dt) if self.cfg.qk_norm else None,
            moe=moe,
            # sinks rounded to the model dtype as the reference holds them, float32 for the softmax
            sinks=w.vector(a + "sinks").float() if self.cfg.attention_sinks else None,
        )

    def _experts(self, w: ModelWeights, i: int) -> MoeMlp | HostExperts:
        """Layer i's router and experts on the device, or, for a host layer, read into host memory (built with the
        model's `use_kernels`: quantized experts stay in their blocks for tandem's CPU kernels) behind the bus."""
        if i not in self.host_expert_layers:
            return self._moe(w, i)
        assert self._host_silu_mul is not None
        return HostExperts(self._moe(w.placed_on(HOST), i), self.expert_bus, self._host_silu_mul)

    def _moe(self, w: ModelWeights, i: int) -> MoeMlp:
        """Layer i's router (dense, in the model dtype) and experts, each expert's gate and up fused as in the MLP."""
        if self.cfg.expert_names == "gpt_oss":
            return self._gpt_oss_moe(w, i)
        k, dt = self.use_kernels, self.dtype
        router, names = moe_weight_names(self.cfg, i)
        experts = [Expert(make_linear([w.matrix(g), w.matrix(u)], None, k, dt), make_linear(w.matrix(d), None, k, dt))
                   for g, u, d in names]
        return MoeMlp(DenseProjection(w.vector(router), None), experts, self.cfg.experts_per_token, self.cfg.norm_topk_prob,
                      kernels=self._moe_kernels(w))

    def _moe_kernels(self, w: ModelWeights) -> bool:
        """Whether a MoE layer read through `w` routes and combines with tandem's CPU kernels (`csrc/moe_ops.cpp`):
        its weights are on the CPU and the model uses the kernels, which load."""
        return self.use_kernels and w.device.type == "cpu" and load_cpu_kernels()

    def _gpt_oss_moe(self, w: ModelWeights, i: int) -> MoeMlp:
        """Layer i's router (with its bias) and experts, every expert a projection of the existing kernels, its bias
        added after the matmul. Experts stored split (a GGUF; MXFP4 blocks, served expert by expert:
        `split_expert_names`) are taken as stored, gate and up fused, MXFP4 kept in its blocks for the quantized
        kernels (dequantized by `make_linear` without them). Stacked ones (a dense HF checkpoint) are cut out: gate_up
        [E, hidden, 2 I] with gate / up interleaved becomes each expert's [gate; up] rows [2 I, hidden] (bias alike),
        down [E, I, hidden] its [hidden, I]."""
        from tandem.models.checkpoint import expert_bias_name, split_expert_names

        k, dt = self.use_kernels, self.dtype
        n = stacked_moe_names(i)
        router = DenseProjection(w.vector(n.router), w.vector(n.router_bias))
        if split_expert_names(i, 0)[0] in w.names:
            split = []
            for e in range(self.cfg.num_experts):
                g, u, d = split_expert_names(i, e)
                gate_up_bias = torch.cat([w.vector(expert_bias_name(g)), w.vector(expert_bias_name(u))])  # [2 I]
                split.append(Expert(make_linear([w.matrix(g), w.matrix(u)], gate_up_bias, k, dt),
                                    make_linear(w.matrix(d), w.vector(expert_bias_name(d)), k, dt)))
            return GptOssMoe(router, split, self.cfg.experts_per_token, self.cfg.swiglu_alpha, self.cfg.swiglu_limit,
                             kernels=self._moe_kernels(w))
        gate_up, gate_up_b = w.matrix(n.gate_up), w.vector(n.gate_up_bias)  # [E, hidden, 2 I], [E, 2 I]
        down, down_b = w.matrix(n.down), w.vector(n.down_bias)  # [E, I, hidden], [E, hidden]
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)  # stacked: read dense
        experts = []
        for e in range(self.cfg.num_experts):
            gu = gate_up[e].t()  # [2 I, hidden], rows gate0, up0, gate1, ...
            fused = make_linear([gu[0::2].contiguous(), gu[1::2].contiguous()], torch.cat([gate_up_b[e, 0::2], gate_up_b[e, 1::2]]), k, dt)
            experts.append(Expert(fused, make_linear(down[e].t().contiguous(), down_b[e].contiguous(), k, dt)))
        del gate_up, down
        return GptOssMoe(router, experts, self.cfg.experts_per_token, self.cfg.swiglu_alpha, self.cfg.swiglu_limit,
                         kernels=self._moe_kernels(w))

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token through every projection, the output one included (of a mixture of
        experts, the router and the k experts a token runs)."""
        dense = [self.lm_head] + [x for la in self.layers for x in (la.qkv, la.o, la.gate_up, la.down) if x is not None]
        return sum(p.out_features * p.in_features for p in dense) + sum(la.moe.active_params for la in self.layers if la.moe)

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights occupy as held (packed, quantized or dense; a shared table counted once)."""
        projections = {id(p): p for p in [self.lm_head, self.embed] + [x for la in self.layers for x in la.projections]}
        vectors = [self.norm] + [t for la in self.layers for t in (la.input_norm, la.post_norm, la.q_norm, la.k_norm, la.sinks)
                                 if t is not None]
        return sum(p.nbytes for p in projections.values()) + sum(t.numel() * t.element_size() for t in vectors)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]; writes this step's K/V into `kv_caches` (one per layer)."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = input_ids.shape[0]
        rope = ops.rope_tables(meta.positions)
        dt = self.dtype
        # the residual stream x stays float32 (norm weights too); each layer's output is added into it by the next norm
        x = self.tp.embed(self.embed, input_ids, self.vocab_size)  # [T, hidden] float32
        if self.decode_stack is not None and self.decode_stack.accepts(meta):
            return self.decode_stack(x, meta, kv_caches)  # the loop below, in C++ (bit-identical)
        delta: torch.Tensor | None = None
        for layer, kv_cache, window in zip(self.layers, kv_caches, self.windows):
            h = ops.add_rms_norm(x, delta, layer.input_norm, eps, dt)
            qkv = layer.qkv(h)  # [T, (H + 2 KVH) D]
            qk = qkv[:, : self.q_size + self.kv_size].view(T, H + KVH, D)
            v = qkv[:, self.q_size + self.kv_size :].view(T, KVH, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = ops.qk_norm(qk, layer.q_norm, layer.k_norm, eps, H)
            qk = ops.rope_write_kv(qk, v, rope, kv_cache, meta, H)  # [T, H + KVH, D], k and v now in the cache
            attn = ops.attention(qk, v, kv_cache, meta, H, self.scale, dt, window, layer.sinks)  # [T, H D]
            h = ops.add_rms_norm(x, self.tp.all_reduce(layer.o(attn)), layer.post_norm, eps, dt)
            delta = self.tp.all_reduce(self._mlp(layer, h))  # [T, hidden], summed over ranks
        return ops.add_rms_norm(x, delta, self.norm, eps, dt)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] (normed, model dtype) -> the MLP's output [T, hidden]: dense, or the token's experts."""
        if layer.moe is not None:
            return layer.moe(h, self.ops.silu_mul)
        assert layer.gate_up is not None and layer.down is not None
        return layer.down(self.ops.silu_mul(layer.gate_up(h)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in float32 (on tensor-parallel rank 0; the others get their slice)."""
        return self.tp.gather_logits(self.lm_head(hidden).float(), self.vocab_size)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer: [2 (K, V), kv_heads, num_blocks, block_size, head_dim]."""
        return (2, self.cfg.num_kv_heads, num_blocks, block_size, self.cfg.head_dim)

