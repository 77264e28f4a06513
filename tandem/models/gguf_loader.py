"""GGUF (llama.cpp) checkpoints: metadata -> HF config, tensors -> HF names in HF layout, quantized blocks kept.

`gguf.GGUFReader` parses the header (metadata and tensor table); the tensors themselves are read one at a time with
plain reads when the model takes them (`GGUFWeights`), so no mapping of the file stays alive. Tensors in a format
tandem's kernels run (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K) stay in their blocks as `QuantizedTensor`s;
F32 / F16 / BF16 ones become dense tensors in the load dtype, and any other quantized type is dequantized with
`gguf.quants.dequantize`. `quantization="none"` dequantizes everything (`WeightStore.stored`).

Mixtures of experts (`qwen3moe`; `llama` with `expert_count`, i.e. Mixtral): each layer's experts are stored as one
3-D tensor per projection (`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, [E, rows, cols] in HF order, experts
one after another), which is split here into E per-expert entries at their byte offsets, each read (and kept in its
blocks) on its own; the router `ffn_gate_inp` is F32 (llama.cpp never quantizes it). Older Mixtral files with one
tensor per expert (`ffn_gate.E`) load too.

gpt-oss (`gpt-oss`, as llama.cpp's converter writes it): `ffn_gate_exps` / `ffn_up_exps` [E, I, hidden] and
`ffn_down_exps` [E, hidden, I] (MXFP4 in the released conversions) with F32 biases of the same names are split per
expert under `split_expert_names` (biases alike), the router `ffn_gate_inp` (weight and bias) and `attn_sinks` under
gpt-oss's HF names. Its config: the experts' width, the window and the layers that slide (llama.cpp's
`sliding_window_pattern`, every even layer when absent), YaRN with `truncate: false` (the released config.json's; the
GGUF has no key for it, and llama.cpp always truncates the ramp's bounds), and llama.cpp's SwiGLU constants (alpha
1.702, limit 7.0: the GGUF stores none).

llama.cpp's converter permutes the rows of `attn_q` / `attn_k` for the `llama` architecture (HF rotate-half pairs
(i, i + D/2) -> interleaved pairs (2i, 2i+1)); we undo it so weights match HF's layout. Qwen2/Qwen3 GGUFs are not
permuted (llama.cpp runs them with NeoX-style rotary, which is HF's layout).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from tandem.config import ConfigError, ModelConfig
from tandem.layers.quant import FORMATS, QuantizedTensor
from tandem.models.checkpoint import (
    Checkpoint,
    WeightStore,
    expert_bias_name,
    file_cache_key,
    interleaved_to_rotate_half,
    moe_weight_names,
    read_at,
    split_expert_names,
    stacked_moe_names,
    write_folder_atomically,
    write_hf_folder,
)
from tandem.paths import tandem_home

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> HF `architectures[0]`
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
_HF_MODEL_TYPES = {"gpt-oss": "gpt_oss"}  # a GGUF architecture -> its HF model_type, where the names differ
# a GGUF architecture with experts -> (HF architecture, model_type)
_MOE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("MixtralForCausalLM", "mixtral"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# model types whose q/k rows llama.cpp permuted to interleaved RoPE pairs (GGUF architecture `llama`)
_PERMUTED_QK = {"llama", "mixtral"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss's (the only architecture here that names it so)
}
_SINKS = "attn_sinks"  # gpt-oss: blk.N.attn_sinks.weight -> model.layers.N.self_attn.sinks (a parameter, no suffix)
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
TOKENIZER_FOLDER_VERSION = "t2"  # t2: a gpt-oss file's folder gets the config.json naming its family
_SKIPPED_TENSORS = {"rope_freqs.weight"}  # folded into the config's rope_scaling (Llama 3)


# expert tensors: GGUF projection -> its index in moe_weight_names' (gate, up, down)
_EXPERT_TENSORS: dict[str, int] = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_PER_EXPERT_TENSORS: dict[str, int] = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}  # old Mixtral files: blk.N.ffn_gate.E


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight");
    experts and routers are named by `expert_tensor_names`."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] == _SINKS:
        return f"model.layers.{parts[1]}.self_attn.sinks"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def expert_tensor_names(gguf_name: str, config: ModelConfig) -> list[str] | None:
    """The HF names a mixture-of-experts GGUF tensor holds: [router] for `ffn_gate_inp`, E names (expert order) for a
    stacked `ffn_*_exps`, one for an old per-expert `ffn_gate.E`; None for any other tensor."""
    parts = gguf_name.split(".")
    if not config.is_moe or parts[0] != "blk" or int(parts[1]) not in config.moe_layers:
        return None
    if config.expert_names == "gpt_oss":
        return _gpt_oss_expert_names(parts, config.num_experts)
    if parts[-1] != "weight":
        return None
    layer = int(parts[1])
    router, experts = moe_weight_names(config, layer)
    if len(parts) == 4 and parts[2] == "ffn_gate_inp":
        return [router]
    if len(parts) == 4 and parts[2] in _EXPERT_TENSORS:
        return [expert[_EXPERT_TENSORS[parts[2]]] for expert in experts]
    if len(parts) == 5 and parts[2] in _PER_EXPERT_TENSORS:
        return [experts[int(parts[3])][_PER_EXPERT_TENSORS[parts[2]]]]
    return None


def _gpt_oss_expert_names(parts: list[str], num_experts: int) -> list[str] | None:
    """gpt-oss's router (weight, bias) and split experts (`split_expert_names`, weights and biases) in a GGUF name's
    parts ("blk", layer, tensor, suffix)."""
    if len(parts) != 4 or parts[3] not in ("weight", "bias"):
        return None
    layer, tensor, suffix = int(parts[1]), parts[2], parts[3]
    if tensor == "ffn_gate_inp":
        n = stacked_moe_names(layer)
        return [n.router if suffix == "weight" else n.router_bias]
    if tensor not in _EXPERT_TENSORS:
        return None
    names = [split_expert_names(layer, e)[_EXPERT_TENSORS[tensor]] for e in range(num_experts)]
    return names if suffix == "weight" else [expert_bias_name(n) for n in names]


def field_value(field: ReaderField) -> Any:
    """Decode a metadata field: a str, an int/float/bool, or a list of those for arrays."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        item = field.types[-1]
        return [_decode_part(field.parts[i], item) for i in field.data]
    return _decode_part(field.parts[field.data[0]], kind)


def _decode_part(part: np.ndarray, kind: GGUFValueType) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if kind == GGUFValueType.FLOAT32 and part.size == 1:  # the shortest decimal of the float32: 1e-05, not 9.99...e-06,
        return float(str(part[0]))  # so values read back equal the config.json the file was converted from
    return part.item() if part.size == 1 else part.tolist()


class GGUFMetadata:
    """Typed access to a reader's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field_value(field)

    def require(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            raise ConfigError(f"{self.path}: GGUF metadata has no {key!r}")
        return field_value(field)

    def array_length(self, key: str) -> int | None:
        field = self.reader.fields.get(key)
        return None if field is None else len(field.data)


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map a GGUF file; ConfigError when it is not one."""
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_hf_config(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """An HF `config.json` dict for the model in a GGUF (llama / qwen2 / qwen3 / qwen3moe / gpt-oss architectures)."""
    meta = GGUFMetadata(reader, path)
    arch = str(meta.require("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; a uniform list is fine
        if len(set(kv_heads)) != 1:
            raise ConfigError(f"{path}: per-layer head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    head_dim = (
        meta.get(f"{arch}.attention.key_length")
        or meta.get(f"{arch}.rope.dimension_count")
        or hidden // heads
    )
    embd_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are [cols, rows]
    vocab = meta.array_length("tokenizer.ggml.tokens") or meta.get(f"{arch}.vocab_size") or embd_rows
    if vocab != embd_rows:
        logger.warning("%s: %d tokens but token_embd has %d rows; using the latter", path, vocab, embd_rows)
        vocab = embd_rows
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": _HF_MODEL_TYPES.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True  # Qwen2ForCausalLM always has q/k/v biases
    cfg.update(_moe_config(meta, arch, tensors, cfg["num_hidden_layers"]))
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = int(pad)
    rope_scaling = _rope_scaling(meta, arch, tensors.get("rope_freqs.weight"), cfg)
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    return cfg


def _moe_config(meta: GGUFMetadata, arch: str, tensors: Mapping[str, ReaderTensor], layers: int) -> dict[str, Any]:
    """The HF mixture-of-experts fields of a GGUF with `{arch}.expert_count` ({} for a dense model): the experts' width
    from `expert_feed_forward_length` (Mixtral's is the feed-forward length), top k from `expert_used_count`, the
    top-k weights renormalized as llama.cpp runs these architectures (`expert_weights_norm` where written), and the
    layers without a router as dense ones (Qwen3-MoE's `mlp_only_layers`)."""
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if experts <= 0:
        return {}
    if arch == "gpt-oss":
        return _gpt_oss_config(meta, experts, layers)
    if arch not in _MOE_ARCHITECTURES:
        raise ConfigError(f"{meta.path}: experts in a {arch!r} GGUF are not supported; with experts: {sorted(_MOE_ARCHITECTURES)}")
    hf_arch, model_type = _MOE_ARCHITECTURES[arch]
    out: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type,
                           "num_experts_per_tok": int(meta.require(f"{arch}.expert_used_count"))}
    if model_type == "mixtral":
        return {**out, "num_local_experts": experts}
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta.require(f"{arch}.feed_forward_length")
    return {**out, "num_experts": experts, "moe_intermediate_size": int(width), "mlp_only_layers": dense,
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)), "decoder_sparse_step": 1}


def _gpt_oss_config(meta: GGUFMetadata, experts: int, layers: int) -> dict[str, Any]:
    """gpt-oss's fields as its config.json spells them: the experts' width and count, attention biases, the window and
    the layers using it (llama.cpp's `sliding_window_pattern`: a bool per layer, or n with layer i sliding unless
    i % n == n - 1; absent: n = 2, the even layers, as gpt-oss alternates), swiglu_limit 7.0 (llama.cpp's constant)."""
    arch = "gpt-oss"
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2)
    sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta.require(f"{arch}.feed_forward_length")
    return {"num_local_experts": experts, "num_experts_per_tok": int(meta.require(f"{arch}.expert_used_count")),
            "intermediate_size": int(width), "attention_bias": True, "swiglu_limit": 7.0,
            "sliding_window": int(meta.require(f"{arch}.attention.sliding_window")),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _rope_scaling(
    meta: GGUFMetadata, arch: str, rope_freqs: ReaderTensor | None, cfg: Mapping[str, Any]
) -> dict[str, Any] | None:
    """HF rope_scaling from `{arch}.rope.scaling.*` keys, or recovered from a Llama 3 `rope_freqs` tensor."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = meta.get(f"{arch}.rope.scaling.{key}")
            if kind == "yarn" and value is not None:
                scaling[hf_key] = float(value)
        if arch == "gpt-oss":  # the released config's; llama.cpp floors / ceils the ramp's bounds whatever the model says
            scaling["truncate"] = False
        return scaling
    if rope_freqs is None:
        return None
    divisors = dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1).astype(np.float64)
    return llama3_scaling_from_rope_freqs(divisors, float(cfg["rope_theta"]), int(cfg["head_dim"]), meta.path)


def llama3_scaling_from_rope_freqs(
    divisors: np.ndarray, theta: float, head_dim: int, path: Path, original: int = 8192
) -> dict[str, Any]:
    """Recover HF's Llama 3 rope_scaling from llama.cpp's per-frequency divisors `rope_freqs` [D/2].

    llama.cpp stores d_i = 1 (wavelength < L/high), `factor` (wavelength > L/low), else 1 / ((1 - s)/factor + s)
    with s = (L / wavelength - low) / (high - low). Only the ratios L/low and L/high matter, so L is fixed at 8192
    (Llama 3.1's value) and low/high follow from a least-squares fit of the smooth band (Llama 3's 1 and 4 when the
    band is empty). The recovered parameters must reproduce every divisor, else ConfigError.
    """
    factor = float(divisors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = original * inv_freq / (2 * math.pi)  # L / wavelength
    low, high = 1.0, 4.0
    band = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if factor > 1 and band.sum() >= 2:
        # s from 1/d = (1 - s)/factor + s; s is linear in x: s = (x - low) / (high - low)
        smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[band], smooth, 1)
        high_minus_low = 1 / slope
        low = -intercept * high_minus_low
        high = low + high_minus_low
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": original,
    }
    wavelen = 2 * math.pi / inv_freq
    s = (original / wavelen - low) / (high - low)
    rebuilt = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, 1 / ((1 - s) / factor + s))
    )
    if not np.allclose(rebuilt, divisors, rtol=1e-4, atol=1e-4):
        raise ConfigError(
            f"{path}: rope_freqs does not follow Llama 3 rope scaling; this GGUF is not supported"
        )
    return scaling


@dataclass(frozen=True)
class _GGUFEntry:
    gguf_name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # HF order: [rows, cols] for matrices
    offset: int  # absolute, in bytes
    nbytes: int
    permute_heads: int  # llama q/k: rows go from interleaved RoPE pairs back to rotate-half over this many heads


class GGUFWeights(WeightStore):
    """The model tensors of a GGUF under HF names, read on demand; quantized blocks kept (see the module doc)."""

    def __init__(self, path: Path, entries: dict[str, _GGUFEntry], dtype: torch.dtype, quantization: str = "auto") -> None:
        self.path = path
        self._entries = entries
        self.dtype = dtype
        self.quantization = quantization

    def names(self) -> list[str]:
        return list(self._entries)

    def qtype(self, name: str) -> str:
        """The GGML type name a weight is stored in ("Q4_K", "F32", ...)."""
        return self._entries[name].ggml_type.name

    def read(self, name: str) -> torch.Tensor | QuantizedTensor:
        e = self._entries[name]
        raw = read_at(self.path, e.offset, e.nbytes)
        kind = e.ggml_type.name
        if kind in FORMATS and len(e.shape) == 2:
            data = raw.reshape(e.shape[0], -1)  # [N, row bytes]: rows of blocks are independent
            if e.permute_heads:
                data = interleaved_to_rotate_half(data, e.permute_heads)
            return QuantizedTensor(kind, (e.shape[0], e.shape[1]), data)
        w = _dense(raw, e.ggml_type, e.shape)
        return interleaved_to_rotate_half(w, e.permute_heads) if e.permute_heads else w


def _dense(raw: torch.Tensor, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == GGMLQuantizationType.F32:
        return raw.view(torch.float32).reshape(shape)
    if kind == GGMLQuantizationType.F16:
        return raw.view(torch.float16).reshape(shape)
    if kind == GGMLQuantizationType.BF16:
        return raw.view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw.numpy(), kind))).reshape(shape)


def gguf_weight_entries(reader: GGUFReader, cfg: Mapping[str, Any]) -> dict[str, _GGUFEntry]:
    """HF name -> where and how the GGUF stores it, for every model tensor (unknown tensors are logged and skipped);
    a stacked expert tensor gives one entry per expert."""
    arch = str(cfg["model_type"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    config = ModelConfig.from_hf(cfg)
    out: dict[str, _GGUFEntry] = {}
    for t in reader.tensors:
        experts = expert_tensor_names(t.name, config)
        if experts is not None:
            out.update(_expert_entries(t, experts))
            continue
        name = hf_tensor_name(t.name)
        if name is None:
            if t.name not in _SKIPPED_TENSORS:
                logger.warning("ignoring unknown GGUF tensor %s", t.name)
            continue
        permute = 0
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            permute = heads
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            permute = kv_heads
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        out[name] = _GGUFEntry(t.name, t.tensor_type, shape, int(t.data_offset), int(t.n_bytes), permute)
    return out


def _expert_entries(t: ReaderTensor, names: list[str]) -> dict[str, _GGUFEntry]:
    """One entry per name over a tensor holding len(names) equal slabs one after another ([E, rows, cols] in HF
    order, or gpt-oss's expert biases [E, rows]; a router or a single expert: one slab)."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    stacked = len(shape) == 3 or (len(shape) == 2 and len(names) > 1)
    if stacked and shape[0] != len(names):
        raise ConfigError(f"{t.name}: {shape[0]} experts stored, the config has {len(names)}")
    slab_shape = shape[1:] if stacked else shape
    slab = int(t.n_bytes) // len(names)
    return {name: _GGUFEntry(t.name, t.tensor_type, slab_shape, int(t.data_offset) + e * slab, slab, 0)
            for e, name in enumerate(names)}


def dequantized_tensor(t: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as a dense torch tensor in HF shape order ([rows, cols]); float32 unless stored F16/BF16."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    if t.tensor_type == GGMLQuantizationType.F32:
        array = np.array(t.data, dtype=np.float32)
    elif t.tensor_type == GGMLQuantizationType.F16:
        array = np.array(t.data, dtype=np.float16)
    else:  # BF16 and every quantized type: dequantize to float32
        array = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def read_gguf(
    path: Path, dtype: torch.dtype, *, progress: bool = True, quantization: str = "auto"
) -> tuple[GGUFReader, dict[str, Any], GGUFWeights]:
    """The open reader (header only is touched), the HF config dict and the HF-named weights of a GGUF."""
    del progress  # tensors are read later, as the model takes them
    reader = open_gguf(path)
    cfg = gguf_hf_config(reader, path)
    return reader, cfg, GGUFWeights(path, gguf_weight_entries(reader, cfg), dtype, quantization)


def gguf_chat_template(reader: GGUFReader, path: Path) -> str | None:
    """The chat template stored in the GGUF metadata (`tokenizer.chat_template`), if any."""
    value = GGUFMetadata(reader, path).get("tokenizer.chat_template")
    return str(value) if value is not None else None


def has_tokenizer(reader: GGUFReader) -> bool:
    """Whether the metadata describes a tokenizer transformers can rebuild (`tokenizer.ggml.model`)."""
    return "tokenizer.ggml.model" in reader.fields


def save_gguf_tokenizer(gguf_path: Path, out_dir: Path, name_family: bool = False) -> None:
    """Rebuild the GGUF's tokenizer with transformers (offline, from metadata) and `save_pretrained` it to out_dir.
    gpt-oss's is built as the fast tokenizer its HF folders name (`PreTrainedTokenizerFast`: byte-level BPE, the
    pre-tokenizer's split from `tokenizer.ggml.pre`, "gpt-4o" for o200k) without `AutoTokenizer`, whose reading of the
    GGUF's config fails on gpt-oss's YaRN keys (transformers 5.24 converts a field's first part, its key, to a float).

    `name_family`: for a tokenizer-only folder, a gpt-oss file also gets a config.json naming the family, so that
    `Tokenizer.from_path` picks harmony when the vocabulary is harmony's, as it does for a checkpoint folder; a
    folder written beside a full config.json leaves it out."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader = open_gguf(gguf_path)
    arch = GGUFMetadata(reader, gguf_path).get("general.architecture")
    builder = PreTrainedTokenizerFast if arch == "gpt-oss" else AutoTokenizer
    tokenizer = builder.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = gguf_chat_template(reader, gguf_path)
    if template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    if name_family and arch == "gpt-oss":
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}))


def gguf_tokenizer_folder(gguf_path: Path) -> Path:
    """A cached folder holding the GGUF's tokenizer: tandem_home()/tokenizers/<stem>-<key>-<version>, built once."""
    folder = tandem_home() / "tokenizers" / f"{gguf_path.stem}-{file_cache_key(gguf_path)}-{TOKENIZER_FOLDER_VERSION}"
    if not (folder / "tokenizer_config.json").is_file():
        write_folder_atomically(folder, lambda tmp: save_gguf_tokenizer(gguf_path, tmp, name_family=True))
    return folder


def load_gguf_checkpoint(
    path: Path, dtype: torch.dtype, *, progress: bool = True, quantization: str = "auto"
) -> Checkpoint:
    """Load a GGUF directly (no conversion on disk); its tokenizer is exported once into tandem's cache."""
    reader, cfg, weights = read_gguf(path, dtype, progress=progress, quantization=quantization)
    config = ModelConfig.from_hf(cfg)
    if has_tokenizer(reader):
        tokenizer_path = gguf_tokenizer_folder(path)
    else:
        logger.warning("%s has no tokenizer metadata; tokenizer_path is its folder", path)
        tokenizer_path = path.parent
    template = gguf_chat_template(reader, path)
    del reader  # its mapping of the file goes with it: the weights are read with plain reads from here on
    return Checkpoint(config, weights, tokenizer_path, template, "gguf")


def convert_gguf_to_hf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write an HF folder (config.json, model.safetensors, tokenizer, generation_config.json) from a GGUF.

    Written atomically into `out_dir` (which must not exist or be empty); loadable by `load_checkpoint` and by
    transformers' `AutoModelForCausalLM.from_pretrained`.
    """
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise ConfigError(f"GGUF file {src} does not exist")
    reader, cfg, store = read_gguf(src, dtype, progress=False)
    weights = {name: store[name] for name in store.names()}  # dense, in `dtype`
    ModelConfig.from_hf(cfg)  # fail early on an unsupported config
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if has_tokenizer(reader):
        return write_hf_folder(Path(out_dir), cfg, weights, lambda tmp: save_gguf_tokenizer(src, tmp))
    logger.warning("%s has no tokenizer metadata; the HF folder gets no tokenizer", src)
    return write_hf_folder(Path(out_dir), cfg, weights)
