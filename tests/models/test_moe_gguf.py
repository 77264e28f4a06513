"""Mixtures of experts from GGUF files, written as llama.cpp's converter writes them (`models/gguf_writer.py`: one
[E, rows, cols] tensor per expert projection, an F32 router): a Qwen3-MoE (`qwen3moe`), a Mixtral (`llama` with
experts) and a gpt-oss (`gpt-oss`: gate and up split, expert biases, sinks, a sliding window, YaRN; MXFP4 experts) of
small random shapes. The BF16 file gives transformers' logits on the same weights (its HF folder); a quantized file
keeps every expert in its blocks; the config read from the metadata is the HF one. The same files against llama.cpp:
tests/models/test_llama_cpp_parity.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.quant import QuantizedTensor
from tandem.models.gguf_writer import file_tensors, write_gguf
from tandem.models.loader import load_checkpoint
from tandem.models.shapes import ModelShape, random_weights, write_hf_model
from tandem.runner.runner import ModelRunner

# every route a real one takes, in seconds: hidden 256 (a K-quant row), 2 of 8 / 2 of 4 experts
TINY_SHAPES = {
    "qwen3moe": ModelShape("tiny-qwen3moe", "qwen3moe", 256, 512, 3, 4, 2, 49152, False, 1e6, 4096, 1e-6,
                           head_size=64, experts=8, experts_used=2, expert_intermediate=128),
    "mixtral": ModelShape("tiny-mixtral", "mixtral", 256, 384, 3, 4, 2, 49152, False, 1e6, 4096, experts=4,
                          experts_used=2, expert_intermediate=384),
    # a window of 8 so that 24-token prompts slide in layers 0 and 2; YaRN's ramp over these positions
    "gpt-oss": ModelShape("tiny-gpt-oss", "gpt-oss", 256, 256, 3, 4, 2, 49152, False, 150000.0, 4096, 1e-5,
                          head_size=64, experts=8, experts_used=2, expert_intermediate=128, sliding_window=8,
                          yarn_factor=32.0, yarn_original=128),
}
STACKED = ["qwen3moe", "mixtral"]  # one [E, rows, cols] tensor holds E experts' matrices
FILE_TYPES = {"qwen3moe": ("Q8_0", "Q4_K_M", "Q5_K_M"), "mixtral": ("Q8_0", "Q4_K_M"), "gpt-oss": ("MXFP4", "MXFP4_MOE")}
QUANTIZED = [(family, file_type) for family, types in FILE_TYPES.items() for file_type in types]
# the random shapes' logits spread ~0.3 and their routers barely choose; these scales give a real model's spread
# (~4) and decisive routing, so that greedy tokens and routes are far from ties
SCALES = {"lm_head.weight": 12.0, "gate.weight": 10.0, "router.weight": 10.0}


def tiny_weights(shape: ModelShape) -> Iterator[tuple[str, np.ndarray]]:
    """The shape's random weights, bf16-rounded (as both files hold them), the output matrix and routers scaled."""
    for name, array in random_weights(shape, seed=5):
        scale = next((s for key, s in SCALES.items() if name.endswith(key)), 1.0)
        yield name, torch.from_numpy(array * np.float32(scale)).to(torch.bfloat16).float().numpy()


def write_tiny_moe(folder: Path, family: str, file_type: str, shape: ModelShape | None = None) -> Path:
    """The tiny `family` model (or `shape`, one of its variants) as a GGUF of `file_type` with the demo model's
    tokenizer (llama.cpp loads it)."""
    from tandem.models.demo import find_demo_gguf

    shape = shape or TINY_SHAPES[family]
    path = folder / f"{shape.name}.{file_type}.gguf"
    if not path.is_file():
        write_gguf(path, shape, tiny_weights(shape), file_type, find_demo_gguf())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe-gguf")
    out: dict[str, Path] = {}
    for family, shape in TINY_SHAPES.items():
        out[f"{family}/hf"] = write_hf_model(shape, folder / f"{family}-hf", weights=tiny_weights(shape))
        for file_type in ("BF16", *FILE_TYPES[family]):
            out[f"{family}/{file_type}"] = write_tiny_moe(folder, family, file_type)
    return out


def _runner(path: Path) -> ModelRunner:
    ckpt = load_checkpoint(path, torch.float32, progress=False)
    return ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=16, num_blocks=16),
                       SchedulerConfig(max_model_len=128))


def _logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """A prefill of all but the last 3 tokens (all rows), then 3 decodes: [len, V]."""
    table = list(range(8))
    rows = [runner.execute(StepPlan(0, [ScheduledRequest("a", tokens[:-3], 0, table, all_logits=True)]))]
    for p in range(len(tokens) - 3, len(tokens)):
        rows.append(runner.execute(StepPlan(1, [ScheduledRequest("a", [tokens[p]], p, table)])))
    return torch.cat(rows)


@pytest.mark.parametrize("family", list(TINY_SHAPES))
def test_the_config_is_read_from_the_metadata(family: str, files: dict[str, Path]) -> None:
    ours = load_checkpoint(files[f"{family}/{FILE_TYPES[family][0]}"], torch.float32, progress=False).config
    hf = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(files[f"{family}/hf"]).to_dict())
    for field in ("family", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
                  "moe_layers", "expert_names", "qk_norm", "head_dim", "num_kv_heads", "rope_theta",
                  "attention_sinks", "sliding_window", "sliding_window_layers", "swiglu_alpha", "swiglu_limit",
                  "attention_bias", "rms_norm_eps"):
        assert getattr(ours, field) == getattr(hf, field), field
    hf_scaling = {k: v for k, v in (hf.rope_scaling or {}).items() if k != "rope_theta"}  # transformers 5 copies it in
    assert (ours.rope_scaling or {}) == hf_scaling


def test_gpt_oss_experts_are_split_as_llama_cpp_writes_them() -> None:
    """gpt-oss's stacked gate_up [E, hidden, 2 I] becomes gate and up [E, I, hidden] each, its biases [E, I] (F32);
    the sinks and router bias keep their own tensors."""
    shape = TINY_SHAPES["gpt-oss"]
    tensors = {name: size for name, size, _ in file_tensors(shape)}
    i, h, e = shape.expert_intermediate, shape.hidden, shape.experts
    assert tensors["blk.0.ffn_gate_exps.weight"] == tensors["blk.0.ffn_up_exps.weight"] == (e, i, h)
    assert tensors["blk.2.ffn_down_exps.weight"] == (e, h, i)
    assert tensors["blk.1.ffn_gate_exps.bias"] == (e, i) and tensors["blk.1.ffn_down_exps.bias"] == (e, h)
    assert tensors["blk.1.attn_sinks.weight"] == (shape.heads,) and tensors["blk.1.ffn_gate_inp.bias"] == (e,)


@pytest.mark.parametrize("family", STACKED)
def test_experts_are_stacked_as_llama_cpp_writes_them(family: str) -> None:
    shape = TINY_SHAPES[family]
    tensors = {name: (size, len(held)) for name, size, held in file_tensors(shape)}
    i, h, e = shape.expert_intermediate, shape.hidden, shape.experts
    assert tensors["blk.0.ffn_gate_exps.weight"] == ((e, i, h), e)
    assert tensors["blk.2.ffn_down_exps.weight"] == ((e, h, i), e)
    assert tensors["blk.1.ffn_gate_inp.weight"] == ((e, h), 1)


@pytest.mark.parametrize("family", list(TINY_SHAPES))
def test_bf16_file_gives_transformers_logits(family: str, files: dict[str, Path]) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(files[f"{family}/hf"], dtype=torch.float32).eval()
    tokens = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]  # [24, V]
    got = _logits(_runner(files[f"{family}/BF16"]), tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-4)
    assert expected.std() > 2  # the scaled output matrix: logits spread as a real model's


@pytest.mark.parametrize(("family", "file_type"), QUANTIZED)
def test_quantized_experts_stay_in_their_blocks(family: str, file_type: str, files: dict[str, Path]) -> None:
    """Each expert a QuantizedTensor of the file's type, read at its own offset; the model's logits near the BF16
    file's (the quantization's own error) and its greedy choices the same where they are clear."""
    path = files[f"{family}/{file_type}"]
    ckpt = load_checkpoint(path, torch.float32, progress=False)
    names = [n for n in ckpt.weights.names() if ".experts." in n and n.endswith(".weight")]
    assert len(names) == 3 * TINY_SHAPES[family].experts * TINY_SHAPES[family].layers
    expert = ckpt.weights.read(names[5])
    assert isinstance(expert, QuantizedTensor) and expert.qtype in ("Q8_0", "Q4_K", "Q5_0", "Q5_K", "Q5_1", "Q6_K", "MXFP4")
    assert (expert.qtype == "MXFP4") == file_type.startswith("MXFP4")
    router = ckpt.weights.read(next(n for n in ckpt.weights.names() if n.endswith(("gate.weight", "router.weight"))))
    assert isinstance(router, torch.Tensor) and router.dtype == torch.float32
    tokens = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    exact = _logits(_runner(files[f"{family}/BF16"]), tokens)
    got = _logits(_runner(path), tokens)
    # measured: mean |difference| 1.3 % of the logits' spread for Q8_0, 18 % for Q4_K_M (4.5 bits on random weights),
    # 12 % for gpt-oss's MXFP4 experts (4.25 bits)
    assert (got - exact).abs().mean() < (0.05 if file_type == "Q8_0" else 0.3) * exact.std()
    if file_type == "Q8_0":
        top2 = exact.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 0.5
        assert clear.sum() >= 8 and torch.equal(got.argmax(-1)[clear], exact.argmax(-1)[clear])
