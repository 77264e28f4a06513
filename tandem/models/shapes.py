"""Real-shaped test models without downloads: random weights in the shape of a named architecture.

Throughput and memory depend on a model's shape (layers, widths, heads, vocabulary), not on its weights' values, so
a random-weight model of Llama 3.2 1B's shape is as fair a benchmark of Llama 3.2 1B as the real one. Each shape
here is written as an HF folder (bf16 safetensors) and as GGUF files in the quantized types llama.cpp users run
(`models/gguf_writer.py`), all with the demo model's tokenizer (its 49,152 tokens; a larger vocabulary is padded with
unused tokens so the embedding and output matrices keep the architecture's true size, a smaller one (Mixtral's
32,000) keeps the first tokens and the merges among them). Rope scaling is left out but for gpt-oss's YaRN (part of
its config; elsewhere it changes no cost). Files live under `tandem_home()/test-models/<shape>/`, built once, never in
the repository.

Shapes: smollm2-135m (the demo model's), smollm2-360m, smollm2-1.7b, llama3.2-1b, qwen2.5-0.5b, llama3.1-8b (for
memory checks; its Q4_K_M GGUF is ~4.9 GB). Mixtures of experts: qwen3-30b-a3b (48 layers, 128 experts, 8 active;
its Q4_K_M GGUF is ~18 GB), mixtral-8x7b (32 layers, 8 experts, 2 active), gpt-oss-20b (24 layers, 32 experts of
width 2880, 4 active; attention sinks, biases, a window of 128 in every even layer; its MXFP4 GGUF is ~13.7 GB, YaRN
kept: llama.cpp and tandem must rotate alike), and layer-reduced variants (`-l8`, `-l4`: the same layers, fewer of
them; gpt-oss-20b-l4's MXFP4_MOE file is ~3.0 GB, its MXFP4 one ~4.2 GB, most of both the 201k-token embedding and
output matrices) for benchmarks that must write and read the file in minutes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from tandem.config import ConfigError
from tandem.models.checkpoint import SAFETENSORS_INDEX, write_folder_atomically
from tandem.paths import tandem_home

INIT_STD = 0.02  # N(0, 0.02) for every matrix (as HF initialises Llama); norm weights are 1
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # gpt-oss's YaRN ramp (YaRN's defaults)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's cost."""

    name: str
    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3moe" | "mixtral" | "gpt-oss"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    max_position: int = 8192
    rms_eps: float = 1e-5
    head_size: int = 0  # 0: hidden / heads
    experts: int = 0  # a mixture of experts in every layer (0: dense)
    experts_used: int = 0
    expert_intermediate: int = 0
    sliding_window: int = 0  # gpt-oss: the window of its even layers (0: none)
    yarn_factor: float = 0.0  # gpt-oss: YaRN from `yarn_original` positions (0: no rope scaling)
    yarn_original: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3moe")

    @property
    def active_params(self) -> int:
        """Parameters multiplied per token (the router and the experts_used experts in a mixture of experts)."""
        unused = (self.experts - self.experts_used) * 3 * self.hidden * self.expert_intermediate * self.layers
        return self.num_params - unused

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in weight_shapes(self))

    def hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.family]],
            "model_type": _HF_MODEL_TYPES.get(self.family, self.family),
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": self.rms_eps,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        if self.family == "qwen2":
            cfg["attention_bias"] = True
        if self.family == "mixtral":
            cfg.update(num_local_experts=self.experts, num_experts_per_tok=self.experts_used)
        elif self.family == "qwen3moe":
            cfg.update(num_experts=self.experts, num_experts_per_tok=self.experts_used, norm_topk_prob=True,
                       moe_intermediate_size=self.expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
        elif self.family == "gpt-oss":
            cfg.update(self._gpt_oss_config())
        return cfg

    def _gpt_oss_config(self) -> dict[str, Any]:
        """gpt-oss's own fields, as its released config.json spells them."""
        cfg: dict[str, Any] = {
            "num_local_experts": self.experts, "num_experts_per_tok": self.experts_used, "experts_per_token": self.experts_used,
            "intermediate_size": self.expert_intermediate, "attention_bias": True, "swiglu_limit": 7.0,
            "sliding_window": self.sliding_window,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)],
        }
        if self.yarn_factor:
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": self.yarn_factor, "beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW,
                                   "original_max_position_embeddings": self.yarn_original, "truncate": False}
            cfg["initial_context_length"] = self.yarn_original
        return cfg


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt-oss": "GptOssForCausalLM"}
_HF_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
_QWEN3_30B_A3B = dict(head_size=128, experts=128, experts_used=8, expert_intermediate=768)
_MIXTRAL_8X7B = dict(experts=8, experts_used=2, expert_intermediate=14336)
_GPT_OSS_20B: dict[str, Any] = dict(head_size=64, experts=32, experts_used=4, expert_intermediate=2880, sliding_window=128,
                    yarn_factor=32.0, yarn_original=4096)


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("smollm2-135m", "llama", 576, 1536, 30, 9, 3, 49152, True, 100000.0),
        ModelShape("smollm2-360m", "llama", 960, 2560, 32, 15, 5, 49152, True, 100000.0),
        ModelShape("smollm2-1.7b", "llama", 2048, 8192, 24, 32, 32, 49152, True, 130000.0),
        ModelShape("llama3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, True, 500000.0),
        ModelShape("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, True, 1000000.0, 32768, 1e-6),
        ModelShape("llama3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, 500000.0),
        ModelShape("qwen3-30b-a3b", "qwen3moe", 2048, 6144, 48, 32, 4, 151936, False, 1e6, 40960, 1e-6, **_QWEN3_30B_A3B),
        ModelShape("qwen3-30b-a3b-l8", "qwen3moe", 2048, 6144, 8, 32, 4, 151936, False, 1e6, 40960, 1e-6, **_QWEN3_30B_A3B),
        ModelShape("mixtral-8x7b", "mixtral", 4096, 14336, 32, 32, 8, 32000, False, 1e6, 32768, **_MIXTRAL_8X7B),
        ModelShape("mixtral-8x7b-l4", "mixtral", 4096, 14336, 4, 32, 8, 32000, False, 1e6, 32768, **_MIXTRAL_8X7B),
        ModelShape("gpt-oss-20b", "gpt-oss", 2880, 2880, 24, 64, 8, 201088, False, 150000.0, 131072, 1e-5, **_GPT_OSS_20B),
        ModelShape("gpt-oss-20b-l4", "gpt-oss", 2880, 2880, 4, 64, 8, 201088, False, 150000.0, 131072, 1e-5, **_GPT_OSS_20B),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None


def weight_shapes(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF weight name of the shape with its size, in the order a checkpoint lists them."""
    h, i, d = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        if shape.family in ("qwen2", "gpt-oss"):
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if shape.family == "gpt-oss":
            out += [(p + "self_attn.o_proj.bias", (h,)), (p + "self_attn.sinks", (shape.heads,))]
        if shape.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        if shape.experts:
            out += _expert_shapes(shape, p)
        else:
            out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
    return out


def _expert_shapes(shape: ModelShape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's router and experts under the family's HF names: the router, then every expert's gate, every up, every
    down (the order a GGUF stacks them in: one [E, rows, cols] tensor per projection)."""
    h, i, n = shape.hidden, shape.expert_intermediate, shape.experts
    if shape.family == "gpt-oss":  # every expert in one tensor per part, as its checkpoints store them
        m = p + "mlp."
        return [(m + "router.weight", (n, h)), (m + "router.bias", (n,)),
                (m + "experts.gate_up_proj", (n, h, 2 * i)), (m + "experts.gate_up_proj_bias", (n, 2 * i)),
                (m + "experts.down_proj", (n, i, h)), (m + "experts.down_proj_bias", (n, h))]
    if shape.family == "mixtral":
        b, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        b, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out: list[tuple[str, tuple[int, ...]]] = [(b + "gate.weight", (n, h))]
    for proj, size in zip(names, ((i, h), (i, h), (h, i))):
        out += [(f"{b}experts.{e}.{proj}.weight", size) for e in range(n)]
    return out


def random_weight(name: str, size: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """One weight, float32, the same for the same (name, size, seed): norms 1, biases and matrices N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return np.ones(size, dtype=np.float32)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    return rng.standard_normal(size, dtype=np.float32) * np.float32(INIT_STD)


def random_weights(shape: ModelShape, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every weight of the shape, one at a time."""
    for name, size in weight_shapes(shape):
        yield name, random_weight(name, size, seed)


def shape_dir(shape: ModelShape) -> Path:
    """Where a shape's generated files live: tandem_home()/test-models/<name>/."""
    return tandem_home() / "test-models" / shape.name


def write_hf_model(shape: ModelShape, out_dir: Path, seed: int = 0, shard_bytes: int = 2 << 30,
                   weights: Iterator[tuple[str, np.ndarray]] | None = None) -> Path:
    """An HF folder of the shape: config.json, bf16 safetensors (shards of at most `shard_bytes`), the demo tokenizer;
    the weights `random_weights(shape, seed)` unless given (HF names, float32, in `weight_shapes` order)."""
    from tandem.models.demo import find_demo_gguf
    from tandem.models.gguf_loader import gguf_tokenizer_folder

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(shape.hf_config(), indent=2) + "\n")
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        size = 0

        def flush() -> None:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            shard.clear()

        for name, array in weights if weights is not None else random_weights(shape, seed):
            t = torch.from_numpy(array).to(torch.bfloat16)
            if shard and size + t.numel() * 2 > shard_bytes:
                flush()
                size = 0
            shard[name] = t
            size += t.numel() * 2
        flush()
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        for f in gguf_tokenizer_folder(find_demo_gguf()).iterdir():
            if f.is_file():
                (tmp / f.name).write_bytes(f.read_bytes())

    return write_folder_atomically(out_dir, fill)
