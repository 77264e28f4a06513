"""gpt-oss against transformers on tiny random-weight checkpoints: attention sinks, alternating sliding-window layers
(a window of 8 in prompts of up to 40 tokens), YaRN RoPE with its attention factor, biased projections, the top-k
softmax router and the clamped SwiGLU experts (gate / up interleaved in the stacked checkpoint tensors). Logits of a
prefill, a chunk over the cache and decodes, one step mixing requests, greedy generation through the engine, and an
MXFP4 checkpoint (`_blocks` / `_scales`, as the released ones) loading to its dequantized weights' logits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import quant_isa
from tandem.layers.quant import QuantizedTensor
from tandem.models.checkpoint import expert_bias_name, split_expert_names, stacked_moe_names
from tandem.models.llama import rope_attention_factor, rope_inv_freq
from tandem.models.loader import load_checkpoint
from tandem.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tandem.runner.runner import ModelRunner
from tests.models.test_moe import GREEDY, generate_tokens, logits_in_chunks, tiny_runner
from tests.tiny import hf_greedy, perturb_norms, save_tiny

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}


def _config(**overrides: Any) -> transformers.GptOssConfig:
    kw: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
                              rope_parameters=dict(YARN), swiglu_limit=0.5, initializer_range=0.05)
    return transformers.GptOssConfig(**{**kw, **overrides})


def _tiny(seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """Random weights with sinks of magnitude ~1 (the initializer's 0.05 would hardly move a softmax) and expert
    outputs large enough that swiglu_limit 0.5 clamps both gate and up."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(_config(**overrides))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.mul_(4.0)
    return perturb_norms(model)


def test_config_and_yarn_tables_match_transformers() -> None:
    """The family, windows, experts and YaRN parameters as transformers reads them, from transformers 5's
    `rope_parameters` and from the released checkpoints' `rope_scaling` + `rope_theta` keys alike."""
    hf = _config()
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert (cfg.family, cfg.sliding_window, cfg.sliding_window_layers) == ("gpt_oss", 8, (0, 2))
    assert cfg.attention_sinks and cfg.attention_bias and cfg.output_bias and cfg.moe_layers == (0, 1, 2, 3)
    assert (cfg.expert_names, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == ("gpt_oss", 8, 2, 64)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rope_theta) == (1.702, 0.5, 150000.0)
    released = {k: v for k, v in hf.to_dict().items() if k != "rope_parameters"}
    released |= {"rope_theta": 150000, "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}}
    from_released = ModelConfig.from_hf(released)
    assert replace(from_released, rope_scaling=None) == replace(cfg, rope_scaling=None)
    assert torch.equal(rope_inv_freq(from_released), rope_inv_freq(cfg))
    assert rope_attention_factor(from_released) == rope_attention_factor(cfg)
    for truncate in (False, True):  # truncate absent counts as true
        rope = {**YARN, "truncate": True} if truncate else YARN
        hf_cfg = _config(rope_parameters=dict(rope))
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        ours = ModelConfig.from_hf(hf_cfg.to_dict())
        torch.testing.assert_close(rope_inv_freq(ours), inv, rtol=0, atol=0)
        assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12) and factor > 1.1
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**hf.to_dict(), "num_experts_per_tok": 9})


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
def test_logits_match_transformers(kernels: bool, tmp_path: Path) -> None:
    """40 positions through windows of 8: a prefill chunk, a chunk over the cache, decodes (one token: k experts).
    With the kernels every layer operation runs tandem's kernels, decode attention with its sinks too."""
    ref = _tiny()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    runner = tiny_runner(tmp_path, kernels)
    assert runner.model.ops.name == ("tandem-cpu" if kernels and load_cpu_kernels() else "torch")
    assert runner.model.layers[0].sinks is not None
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]  # [40, V]
    got = logits_in_chunks(runner, ids[0].tolist(), 13, 35, list(range(10)))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_sinks_window_and_clamp_are_exercised() -> None:
    """Negative controls: the reference's logits move when the sinks are dropped, the window widened or the SwiGLU
    limit lifted, so the parity above stands on each of them."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = _tiny()
    with torch.no_grad():
        base = ref(ids).logits
        variants = [_tiny(sliding_window=64), _tiny(swiglu_limit=7.0), _tiny()]
        for layer in variants[2].model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        for model in variants:
            assert (model(ids).logits - base).abs().max() > 1e-3


def test_a_mixed_batch_routes_each_request_as_alone(tmp_path: Path) -> None:
    """A prefill, two decodes and a 4-token verify chunk in one step: each row is transformers' for its sequence."""
    ref = _tiny()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    runner = tiny_runner(tmp_path, kernels=True)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 21, 12)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    with torch.no_grad():
        expected = [ref(torch.tensor([s])).logits[0] for s in seqs]
    runner.execute(StepPlan(0, [ScheduledRequest(f"r{i}", s[:-4], 0, tables[i]) for i, s in enumerate(seqs[1:], 1)]))
    step = [ScheduledRequest("r0", seqs[0], 0, tables[0]),
            ScheduledRequest("r1", [seqs[1][-4]], len(seqs[1]) - 4, tables[1]),
            ScheduledRequest("r2", [seqs[2][-4]], len(seqs[2]) - 4, tables[2]),
            ScheduledRequest("r3", seqs[3][-4:], len(seqs[3]) - 4, tables[3], 3)]
    got = runner.execute(StepPlan(1, step))
    want = torch.cat([expected[0][-1:], expected[1][-4:-3], expected[2][-4:-3], expected[3][-4:]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


PROMPTS = ["t1 t2 t3 t4 t1 t2 t3 t4 t1 t2 t3 t4", "t5 t9 t20 t30 t31 t40 t41 t50 t51", "t7"]


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    # larger weights: greedy text that wanders (at 0.05 every prompt fell into the same two-token loop)
    return str(save_tiny(tmp_path_factory.mktemp("tiny-gpt-oss"), _tiny(initializer_range=0.2)))


def test_engine_greedy_equals_transformers_generate(gpt_oss_folder: str) -> None:
    """12 new tokens past prompts of 1-12 tokens (past the window of 8): one request at a time and all in one batch."""
    want = hf_greedy(gpt_oss_folder, PROMPTS)
    assert len({t for w in want for t in w}) > 12  # not one short loop for every prompt
    assert generate_tokens(gpt_oss_folder, PROMPTS, GREEDY, max_num_seqs=1) == want
    assert generate_tokens(gpt_oss_folder, PROMPTS, GREEDY) == want


def test_tensor_parallel_keeps_the_tokens(gpt_oss_folder: str) -> None:
    """2 ranks, each 2 query heads with their sinks, 1 kv head and half of every expert's width (the down bias on
    rank 0): the single-rank engine's greedy tokens."""
    assert generate_tokens(gpt_oss_folder, PROMPTS, GREEDY, tensor_parallel_size=2) == generate_tokens(gpt_oss_folder, PROMPTS, GREEDY)


def _write_mxfp4(dense: Path, out: Path) -> None:
    """`dense`'s checkpoint with every stacked expert weight as MXFP4 blocks and scales (already exact in MXFP4)."""
    out.mkdir()
    tensors = load_file(str(dense / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_loads_to_its_dequantized_weights(tmp_path: Path) -> None:
    """Experts rounded to MXFP4 (random scales spread over 2^-9..2^-1): the dequantizer is transformers' to the bit;
    a folder storing them as `_blocks` / `_scales`, dequantized (no kernels), gives the logits of the folder storing
    them dense, in float32 and bf16 alike (the values are exact in both). Kept in their blocks for the quantized
    kernels (activations rounded to int8 per 32-block, as llama.cpp's), the logits stay within that rounding of
    transformers' and the greedy tokens are its."""
    ref = _tiny(1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in ref.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.mul_(torch.exp2(torch.randint(-3, 4, (p.shape[0], 1, p.shape[2]), generator=g)))
                blocks, scales = quantize_mxfp4(p.data)
                for dtype in (torch.float32, torch.bfloat16):
                    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
                    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), want)
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32))
                assert (scales.int().max() - scales.int().min()) >= 4
    ref.save_pretrained(tmp_path / "dense", safe_serialization=True)
    _write_mxfp4(tmp_path / "dense", tmp_path / "mxfp4")
    assert not any("gate_up_proj_blocks" in n for n in load_file(str(tmp_path / "dense" / "model.safetensors")))
    ids = torch.randint(0, 128, (1, 20), generator=g)
    with torch.no_grad():
        expected = ref(ids).logits[0]
    plan = StepPlan(0, [ScheduledRequest("a", ids[0].tolist(), 0, list(range(8)), all_logits=True)])
    got = {name: tiny_runner(tmp_path / name, kernels=False).execute(plan) for name in ("dense", "mxfp4")}
    assert torch.equal(got["dense"], got["mxfp4"])
    torch.testing.assert_close(got["mxfp4"], expected, rtol=1e-4, atol=1e-4)
    dense, blocks = (load_checkpoint(tmp_path / name, torch.float32, progress=False).weights for name in ("dense", "mxfp4"))
    for layer in range(ref.config.num_hidden_layers):  # served expert by expert, in their blocks, exactly the weights
        n = stacked_moe_names(layer)
        gate_up, down, gate_up_b = dense.read(n.gate_up), dense.read(n.down), dense.read(n.gate_up_bias)
        for e in range(ref.config.num_local_experts):
            g, u, d = split_expert_names(layer, e)
            parts = {g: gate_up[e][:, 0::2].t(), u: gate_up[e][:, 1::2].t(), d: down[e].t()}
            for name, want in parts.items():
                got_w = blocks.read(name)
                assert isinstance(got_w, QuantizedTensor) and torch.equal(got_w.dequantize(torch.float32), want)
            assert torch.equal(blocks.read(expert_bias_name(g)), gate_up_b[e, 0::2])
    if load_cpu_kernels() and quant_isa() > 0:  # the kernels round activations to int8 per block: a route may flip
        quantized = tiny_runner(tmp_path / "mxfp4", kernels=True).execute(plan)  # [20, V]
        assert float((quantized - expected).abs().mean()) < 0.02 * float(expected.abs().max())
    bf16 = []
    for name in ("dense", "mxfp4"):
        ckpt = load_checkpoint(tmp_path / name, torch.bfloat16, progress=False)
        runner = ModelRunner(ckpt.config, ckpt.weights, torch.bfloat16, "cpu", CacheConfig(block_size=4, num_blocks=16),
                             SchedulerConfig(max_model_len=64), use_kernels=False)
        bf16.append(runner.execute(plan))
    assert torch.equal(bf16[0], bf16[1])
