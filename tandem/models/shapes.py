"""Real-shaped test models without downloads: random weights in the shape of a named architecture.

Throughput and memory depend on a model's shape (layers, widths, heads, vocabulary), not on its weights' values, so
a random-weight model of Llama 3.2 1B's shape is as fair a benchmark of Llama 3.2 1B as the real one. Each shape
here is written as an HF folder (bf16 safetensors) and as GGUF files in the quantized types llama.cpp users run
(`models/gguf_writer.py`), all with the demo model's tokenizer (its 49,152 tokens; a larger vocabulary is padded with
unused tokens so the embedding and output matrices keep the architecture's true size). Rope scaling is left out
(it changes no cost). Files live under `tandem_home()/test-models/<shape>/`, built once, never in the repository.

Shapes: smollm2-135m (the demo model's), smollm2-360m, smollm2-1.7b, llama3.2-1b, qwen2.5-0.5b, llama3.1-8b (for
memory checks; its Q4_K_M GGUF is ~4.9 GB).
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


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's cost."""

    name: str
    family: str  # "llama" | "qwen2"
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in weight_shapes(self))

    def hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if self.family == "qwen2" else "LlamaForCausalLM"],
            "model_type": self.family,
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
        return cfg


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("smollm2-135m", "llama", 576, 1536, 30, 9, 3, 49152, True, 100000.0),
        ModelShape("smollm2-360m", "llama", 960, 2560, 32, 15, 5, 49152, True, 100000.0),
        ModelShape("smollm2-1.7b", "llama", 2048, 8192, 24, 32, 32, 49152, True, 130000.0),
        ModelShape("llama3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, True, 500000.0),
        ModelShape("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, True, 1000000.0, 32768, 1e-6),
        ModelShape("llama3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, 500000.0),
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
        if shape.family == "qwen2":
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
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


def write_hf_model(shape: ModelShape, out_dir: Path, seed: int = 0, shard_bytes: int = 2 << 30) -> Path:
    """An HF folder of the shape: config.json, bf16 safetensors (shards of at most `shard_bytes`), the demo tokenizer."""
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

        for name, array in random_weights(shape, seed):
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
