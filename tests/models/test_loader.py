"""HF safetensors folders -> Checkpoint: weights, dtypes, config fields, sharding and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tandem.config import ConfigError, ModelConfig
from tandem.models.checkpoint import (
    expected_weight_names,
    interleaved_to_rotate_half,
    read_chat_template,
    resolve_dtype,
)
from tandem.models.loader import load_checkpoint

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_model(kind: str, **overrides: Any) -> PreTrainedModel:
    """A random tiny model of one family; deterministic weights."""
    torch.manual_seed(0)
    classes: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    return model_cls(config_cls(**{**TINY, **overrides})).eval()


def save(model: PreTrainedModel, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(folder), **kwargs)
    return folder


def assert_same_weights(loaded: dict[str, torch.Tensor], model: PreTrainedModel, dtype: torch.dtype) -> None:
    state = model.state_dict()
    assert set(loaded) == set(expected_weight_names(ModelConfig.from_hf(model.config.to_dict())))
    for name, tensor in loaded.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, state[name].to(dtype)), name


@pytest.mark.parametrize(
    ("kind", "overrides", "family"),
    [
        ("llama", {"tie_word_embeddings": True}, "llama"),
        ("llama", {"tie_word_embeddings": False}, "llama"),
        ("mistral", {}, "llama"),
        ("qwen2", {}, "qwen2"),
        ("qwen3", {"head_dim": 32}, "qwen3"),
    ],
)
def test_hf_folder_weights_equal_state_dict(tmp_path: Path, kind: str, overrides: dict, family: str) -> None:
    model = tiny_model(kind, **overrides)
    ckpt = load_checkpoint(save(model, tmp_path / kind), torch.float32, progress=False)
    assert ckpt.source == "hf"
    assert ckpt.tokenizer_path == tmp_path / kind
    assert ckpt.config.family == family
    assert_same_weights(ckpt.weights, model, torch.float32)
    names = set(ckpt.weights)
    assert ("lm_head.weight" in names) == (not ckpt.config.tie_word_embeddings)
    assert ("model.layers.1.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("model.layers.1.self_attn.k_norm.weight" in names) == (family == "qwen3")
    assert not any("rotary_emb" in n for n in names)


def test_config_fields_carried_through(tmp_path: Path) -> None:
    model = tiny_model(
        "llama",
        rope_scaling=dict(LLAMA3_ROPE),
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        eos_token_id=[2, 7],
    )
    cfg = load_checkpoint(save(model, tmp_path / "m"), progress=False).config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 131072
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "llama3"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert cfg.rope_scaling[key] == LLAMA3_ROPE[key]


def test_qwen3_config_has_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    cfg = load_checkpoint(save(tiny_model("qwen3", head_dim=32), tmp_path / "q"), progress=False).config
    assert cfg.qk_norm and cfg.head_dim == 32 and not cfg.attention_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sharded_folder_in_each_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    model = tiny_model("llama", tie_word_embeddings=False)
    folder = save(model, tmp_path / "sharded", max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    ckpt = load_checkpoint(folder, dtype, progress=False)
    assert_same_weights(ckpt.weights, model, dtype)


def test_resolve_dtype() -> None:
    def cfg(torch_dtype: str | None) -> ModelConfig:
        return ModelConfig("llama", 8, 8, 8, 1, 1, 1, 8, torch_dtype=torch_dtype)

    assert resolve_dtype("float16", cfg(None)) is torch.float16
    assert resolve_dtype("auto", cfg("float32")) is torch.float32
    assert resolve_dtype("auto", cfg("float16")) is torch.float16
    assert resolve_dtype("auto", cfg(None)) is torch.bfloat16
    with pytest.raises(ConfigError, match="float32.*bfloat16.*float16.*auto"):
        resolve_dtype("int8", cfg(None))


def test_interleaved_to_rotate_half_moves_pairs_to_halves() -> None:
    # one head of dim 4, rows stored as pairs (x0, y0, x1, y1) -> halves (x0, x1, y0, y1); two heads independently
    w = torch.arange(8.0).reshape(8, 1)
    assert interleaved_to_rotate_half(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_chat_template_read_from_tokenizer_files(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert read_chat_template(tmp_path) == "{{ messages }}"
    (tmp_path / "chat_template.jinja").write_text("jinja!")
    assert read_chat_template(tmp_path) == "jinja!"


# --- errors -------------------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config_json(tmp_path: Path) -> None:
    folder = save(tiny_model("llama"), tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(folder)


def test_unknown_architecture(tmp_path: Path) -> None:
    folder = save(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(folder)


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    folder = save(tiny_model("llama"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin.*not loaded.*safety"):
        load_checkpoint(folder)


def test_missing_shard(tmp_path: Path) -> None:
    folder = save(tiny_model("llama"), tmp_path / "m", max_shard_size="50KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{shard.name}.*missing"):
        load_checkpoint(folder)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    folder = save(tiny_model("llama"), tmp_path / "m")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"model\.safetensors.*corrupt or truncated"):
        load_checkpoint(folder, progress=False)


def test_missing_weight_named(tmp_path: Path) -> None:
    model = tiny_model("qwen2", tie_word_embeddings=False)
    folder = save(model, tmp_path / "m")
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k != "model.layers.1.self_attn.k_proj.bias"
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"1 weight\(s\) missing.*2 layers: model\.layers\.1\.self_attn\.k_proj\.bias$"
    ):
        load_checkpoint(folder, progress=False)


def test_unsupported_file_suffix(tmp_path: Path) -> None:
    file = tmp_path / "weights.pt"
    file.write_bytes(b"x")
    with pytest.raises(ConfigError, match="unsupported checkpoint file"):
        load_checkpoint(file)
