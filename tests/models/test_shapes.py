"""Real-shaped random-weight models: the shapes' sizes, and GGUF files written as llama.cpp writes them (names, q/k
order, quantized types, the Q4_K_M mix) that load back into the same weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem.layers.quant import QuantizedTensor
from tandem.models.gguf_writer import quantize_q4_k, quantize_q5_k, quantize_q6_k, tensor_type, write_gguf
from tandem.models.loader import load_checkpoint
from tandem.models.shapes import SHAPES, ModelShape, random_weights

TINY = ModelShape("tiny", "llama", 256, 512, 3, 4, 2, 320, False, 10000.0, 256)


@pytest.mark.parametrize(("name", "params"), [
    ("smollm2-135m", 134_515_008), ("smollm2-360m", 361_821_120), ("smollm2-1.7b", 1_711_376_384),
    ("llama3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768), ("llama3.1-8b", 8_030_261_248),
])
def test_shapes_have_the_architectures_parameter_counts(name: str, params: int) -> None:
    assert SHAPES[name].num_params == params


@pytest.mark.parametrize(("name", "params", "active"), [
    ("qwen3-30b-a3b", 30_532_122_624, 3.3e9),  # Qwen3-30B-A3B: 30.5B total, 3.3B activated
    ("mixtral-8x7b", 46_702_792_704, 12.9e9),  # Mixtral-8x7B: 46.7B, 12.9B per token
    ("gpt-oss-20b", 20_914_757_184, 3.61e9 + 201088 * 2880),  # gpt-oss-20b: 20.91B, 3.61B active without the embedding
], ids=["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"])
def test_moe_shapes_have_the_released_models_parameter_counts(name: str, params: int, active: float) -> None:
    """The mixtures of experts' totals are the released checkpoints' (counted from their sizes, no weight
    allocated), and the parameters a token multiplies (router, k experts) their model cards' active counts (rounded
    there: Qwen3's 3.35B is "3.3B")."""
    shape = SHAPES[name]
    assert shape.num_params == params
    assert abs(shape.active_params - active) < 0.02 * active


@pytest.mark.parametrize(("variant", "full"), [("qwen3-30b-a3b-l8", "qwen3-30b-a3b"), ("mixtral-8x7b-l4", "mixtral-8x7b"),
                                               ("gpt-oss-20b-l4", "gpt-oss-20b")], ids=lambda v: str(v))
def test_layer_reduced_moe_shapes_drop_whole_layers(variant: str, full: str) -> None:
    """A `-l8` / `-l4` variant is its model with fewer of the same layers: every size but the layer count equal, and
    the parameters it lacks (total and active) whole layers' worth."""
    small, big = SHAPES[variant], SHAPES[full]
    assert dataclasses.replace(big, name=small.name, layers=small.layers) == small
    assert small.layers == int(variant.rsplit("-l", 1)[1]) < big.layers
    outside = (1 + (not big.tied)) * big.vocab * big.hidden + big.hidden  # embedding, output matrix, final norm
    per_layer, rest = divmod(big.num_params - outside, big.layers)
    assert rest == 0 and small.num_params == outside + small.layers * per_layer
    active_per_layer, rest = divmod(big.active_params - outside, big.layers)
    assert rest == 0 and small.active_params == outside + small.layers * active_per_layer


@pytest.mark.parametrize(("quantizer", "kind"), [(quantize_q4_k, gguf.GGMLQuantizationType.Q4_K),
                                                  (quantize_q5_k, gguf.GGMLQuantizationType.Q5_K),
                                                  (quantize_q6_k, gguf.GGMLQuantizationType.Q6_K)])
def test_k_quantizers_write_valid_blocks(quantizer, kind) -> None:  # type: ignore[no-untyped-def]
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * 0.02
    x[0, :256] = 0.0  # an all-zero block
    back = gguf.quants.dequantize(quantizer(x), kind).reshape(x.shape)
    assert np.all(back[0, :256] == 0)
    bound = {gguf.GGMLQuantizationType.Q4_K: 0.1, gguf.GGMLQuantizationType.Q5_K: 0.05}.get(kind, 0.03)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < bound  # measured 0.077 / 0.038 for Q4_K / Q5_K


def test_q4_k_m_mix_follows_llama_cpp() -> None:
    n = 32  # use_more_bits: layers 0-3, 28-31 and every third in between
    assert tensor_type("Q4_K_M", "blk.0.attn_v.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q6_K
    assert tensor_type("Q4_K_M", "blk.4.ffn_down.weight", 14336, n, False) == gguf.GGMLQuantizationType.Q4_K
    assert tensor_type("Q4_K_M", "blk.6.ffn_down.weight", 14336, n, False) == gguf.GGMLQuantizationType.Q6_K
    assert tensor_type("Q4_K_M", "blk.6.attn_q.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q4_K
    assert tensor_type("Q4_K_M", "output.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q6_K
    assert tensor_type("Q4_K_M", "token_embd.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q4_K
    assert tensor_type("Q4_K_M", "token_embd.weight", 576, n, True) == gguf.GGMLQuantizationType.Q8_0  # tied, 576 % 256
    assert tensor_type("Q4_K_M", "blk.1.ffn_up.weight", 576, n, True) == gguf.GGMLQuantizationType.Q5_0
    # Q5_K_M: the same mix around Q5_K, Q5_1 where a row is not a multiple of 256
    assert tensor_type("Q5_K_M", "blk.0.attn_v.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q6_K
    assert tensor_type("Q5_K_M", "blk.4.ffn_down.weight", 14336, n, False) == gguf.GGMLQuantizationType.Q5_K
    assert tensor_type("Q5_K_M", "output.weight", 4096, n, False) == gguf.GGMLQuantizationType.Q6_K
    assert tensor_type("Q5_K_M", "blk.1.ffn_up.weight", 576, n, True) == gguf.GGMLQuantizationType.Q5_1


@pytest.mark.parametrize("file_type", ["BF16", "Q8_0", "Q4_K_M", "Q5_K_M"])
def test_written_gguf_loads_back_to_the_same_weights(tmp_path: Path, file_type: str) -> None:
    source = {name: torch.from_numpy(a).bfloat16().float() for name, a in random_weights(TINY, seed=3)}
    path = write_gguf(tmp_path / f"tiny.{file_type}.gguf", TINY, ((n, t.numpy()) for n, t in source.items()), file_type, None)
    ckpt = load_checkpoint(path, torch.float32, progress=False)
    assert set(ckpt.weights) == set(source)
    kinds = set()
    for name, want in source.items():
        stored = ckpt.weights.stored(name)
        kinds.add(stored.qtype if isinstance(stored, QuantizedTensor) else "dense")
        got = ckpt.weights[name]
        if file_type == "BF16" or want.dim() == 1:
            assert torch.equal(got, want), name  # exact: bf16 values, q/k rows back in HF order
        else:
            assert float((got - want).norm() / want.norm()) < 0.1, name
    expected = {"BF16": {"dense"}, "Q8_0": {"dense", "Q8_0"}, "Q4_K_M": {"dense", "Q4_K", "Q6_K"},
                "Q5_K_M": {"dense", "Q5_K", "Q6_K"}}[file_type]
    assert kinds == expected


def test_a_smaller_vocabulary_cuts_the_tokenizer(tmp_path: Path) -> None:
    """A shape with fewer tokens than the demo tokenizer (Mixtral's 32,000 against 49,152) keeps its first tokens and
    only the merges among them, so the token list matches the embedding (llama.cpp refuses a file where it does not)
    and every merge a tokenizer can apply yields a kept token."""
    from tandem.models.demo import find_demo_gguf
    from tandem.tokenizer import Tokenizer

    path = write_gguf(tmp_path / "tiny.BF16.gguf", TINY, ((n, a) for n, a in random_weights(TINY, seed=3)), "BF16",
                      find_demo_gguf())
    fields = gguf.GGUFReader(str(path)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    assert len(tokens) == len(fields["tokenizer.ggml.token_type"].contents()) == TINY.vocab
    assert 0 < len(merges) < len(gguf.GGUFReader(str(find_demo_gguf())).fields["tokenizer.ggml.merges"].contents())
    assert all(a in tokens and b in tokens and a + b in tokens for a, _, b in (m.partition(" ") for m in merges))
    ids = Tokenizer.from_path(load_checkpoint(path, torch.float32, progress=False).tokenizer_path).encode("hello world")
    assert ids and max(ids) < TINY.vocab
