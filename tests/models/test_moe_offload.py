"""Experts on the host (`cpu_offload_experts`, `tandem/layers/moe_offload.py`): which layers a setting picks (as
llama.cpp's `--n-cpu-moe N` counts), the flag, the placement (exactly the chosen layers' experts are host projections
built for tandem's kernels, quantized ones kept quantized; the other layers as without the option), the CPU device's
no-op hop (identical logits and greedy tokens for none / first N / all), and a fake device: a bus whose copies are
real copies, recorded, proves that each offloaded layer sends T x hidden activations to the host and back once per
step and nothing else (no router logits), that the formula counts those bytes, and (negative control) that the layer's
output really comes back through the bus. On CUDA: host experts' logits against the CPU reference, placement, no
graphs, the bus meter against the formula."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.cpu_budget import plan_cpu_budget
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.layers.moe import MoeMlp
from tandem.layers.moe_offload import (
    ExpertBus,
    HostExperts,
    bus_bytes,
    check_offload_setting,
    host_expert_layers,
)
from tandem.layers.parallel import TensorParallel
from tandem.models.loader import load_checkpoint
from tandem.runner.runner import ModelRunner
from tests.models.test_moe import GREEDY, PROMPTS, TINY, generate_tokens, logits_in_chunks
from tests.tiny import perturb_norms, save_tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed_moe() -> transformers.PreTrainedModel:
    """Qwen3-MoE, 3 layers, layer 1 dense (mlp_only_layers): N = 2 offloads layer 0 only, as llama.cpp would."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                      norm_topk_prob=False, mlp_only_layers=[1])
    return perturb_norms(transformers.Qwen3MoeForCausalLM(cfg))


def _gpt_oss() -> transformers.PreTrainedModel:
    """A tiny gpt-oss: biased router and experts (the biases are vectors: they must follow the experts to the host)."""
    torch.manual_seed(1)
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                                    initializer_range=0.05)
    return perturb_norms(transformers.GptOssForCausalLM(cfg))


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-moe-mixed"), _mixed_moe())


def _runner(folder: Path, setting: Any = None, device: str = "cpu", quantization: str | None = None,
            kernels: bool = True) -> ModelRunner:
    ckpt = load_checkpoint(folder, torch.float32, progress=False, quantization=quantization)
    return ModelRunner(ckpt.config, ckpt.weights, torch.float32, device, CacheConfig(block_size=4, num_blocks=64),
                       SchedulerConfig(max_model_len=64), use_kernels=kernels, cpu_offload_experts=setting)


def _logits(runner: ModelRunner) -> torch.Tensor:
    """Every position's logits [30, V] (a prefill chunk, a chunk over the cache, decodes of one token)."""
    tok = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    return logits_in_chunks(runner, tok, 11, 27, list(range(8))).cpu()


# ------------------------------------------------------------------------------------------------ the setting
def test_a_setting_picks_layers_as_llama_cpp_counts_them() -> None:
    """N picks the MoE layers with an index below N (llama.cpp's `blk.{i}.ffn_*_exps` for i < N): a dense layer
    among them counts but moves nothing, N past the end is all; 'all' and digit strings too."""
    cfg = ModelConfig.from_hf(_mixed_moe().config.to_dict())
    assert cfg.moe_layers == (0, 2)
    picks = {s: host_expert_layers(cfg, s) for s in (None, 0, 1, 2, 3, 99, "all", "ALL", "2", " 3 ")}
    assert picks == {None: (), 0: (), 1: (0,), 2: (0,), 3: (0, 2), 99: (0, 2), "all": (0, 2), "ALL": (0, 2), "2": (0,), " 3 ": (0, 2)}
    for bad in (-1, "-1", "some", True, 1.5, "1.5"):
        with pytest.raises(ConfigError, match="cpu_offload_experts must be 'all' or a number of layers"):
            check_offload_setting(bad)
    dense = ModelConfig.from_hf(transformers.Qwen3Config(**TINY).to_dict())
    assert host_expert_layers(dense, "all") == ()


def test_a_dense_model_logs_a_no_op(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    folder = save_tiny(tmp_path, perturb_norms(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16))))
    with caplog.at_level(logging.WARNING, logger="tandem"):
        runner = _runner(folder, "all")
    assert runner.host_expert_layers == () and "selects no mixture-of-experts layer" in caplog.text


def test_the_flag_reaches_build_engine_and_a_bad_value_stops_early() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["cpu_offload_experts"] is None
    assert engine_kwargs(p.parse_args(["--cpu-offload-experts", "all"]))["cpu_offload_experts"] == "all"
    assert engine_kwargs(p.parse_args(["--cpu-offload-experts", "12"]))["cpu_offload_experts"] == 12
    for bad in ("-3", "half"):
        with pytest.raises(SystemExit):
            p.parse_args(["--cpu-offload-experts", bad])
    from tandem import LLM

    with pytest.raises(ConfigError, match="cpu_offload_experts"):  # before the (missing) checkpoint is read
        LLM("/nonexistent/model", cpu_offload_experts=-1, progress=False)


def test_tensor_parallel_and_offload_are_refused(mixed_folder: Path) -> None:
    ckpt = load_checkpoint(mixed_folder, torch.float32, progress=False)
    with pytest.raises(ConfigError, match="tensor parallel"):
        ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=4, num_blocks=8),
                    SchedulerConfig(max_model_len=64), tp=TensorParallel(0, 2), cpu_offload_experts=1)


def test_host_experts_take_the_forwards_cores_in_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside an accelerator the forward normally needs a few host threads; with experts on the host it is a host
    computation and gets every core of its set, as on a CPU device."""
    monkeypatch.delenv("TANDEM_NUM_THREADS", raising=False)  # the suite's own cap (conftest)
    cores = tuple(range(8))
    assert plan_cpu_budget(device="cuda", cores=cores).forward_threads == 4
    assert plan_cpu_budget(device="cuda", cores=cores, host_experts=True).forward_threads == 8
    assert plan_cpu_budget(device="cuda", cores=cores, host_experts=True, draft_on_cpu=True).forward_threads == 6


# ------------------------------------------------------------------------------------------------ placement
def test_exactly_the_chosen_layers_hold_host_experts_kept_quantized(mixed_folder: Path) -> None:
    """int8 experts: the offloaded layer's are host projections for tandem's kernels (still int8), behind the bus;
    the other MoE layer is the plain `MoeMlp` it is without the option, projection for projection."""
    from tandem.layers.kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("tandem's CPU kernels did not build on this machine")
    plain = _runner(mixed_folder, None, quantization="int8")
    first = _runner(mixed_folder, 1, quantization="int8")
    host, dense, kept = first.model.layers
    assert isinstance(host.moe, HostExperts) and dense.moe is None and isinstance(kept.moe, MoeMlp)
    projections = [p for e in host.moe.experts for p in (e.gate_up, e.down)]
    assert {p.kind for p in projections} == {"quant"}  # quantized, in tandem's kernel layout
    assert all(t.device.type == "cpu" for p in projections for t in p.kernel_segments().packed)  # type: ignore[union-attr]
    assert host.moe.router.weight.device.type == "cpu"  # type: ignore[attr-defined]
    assert host.moe.bus is first.model.expert_bus and not host.moe.bus.crosses  # the CPU device: no copies
    ref = plain.model.layers[2].moe
    assert ref is not None
    assert [(p.kind, p.nbytes) for e in kept.moe.experts for p in (e.gate_up, e.down)] == \
        [(p.kind, p.nbytes) for e in ref.experts for p in (e.gate_up, e.down)]
    assert first.forward_uses_host_cores and first.stats_dict() == {}
    torch.testing.assert_close(_logits(first), _logits(plain), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ CPU as device
@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
def test_none_first_n_and_all_give_the_same_logits_on_the_cpu(mixed_folder: Path, kernels: bool) -> None:
    want = _logits(_runner(mixed_folder, None, kernels=kernels))
    for setting in (1, 3, "all"):
        torch.testing.assert_close(_logits(_runner(mixed_folder, setting, kernels=kernels)), want, rtol=0, atol=0)


def test_gpt_oss_experts_and_biases_go_to_the_host(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path, _gpt_oss())
    want = _logits(_runner(folder, None))
    runner = _runner(folder, "all")
    assert all(isinstance(la.moe, HostExperts) for la in runner.model.layers)
    torch.testing.assert_close(_logits(runner), want, rtol=0, atol=0)


def test_engine_greedy_tokens_are_the_same_for_none_first_n_and_all(mixed_folder: Path) -> None:
    want = generate_tokens(str(mixed_folder), PROMPTS, GREEDY)
    for setting in (1, "all"):
        assert generate_tokens(str(mixed_folder), PROMPTS, GREEDY, cpu_offload_experts=setting) == want


# ------------------------------------------------------------------------------------------------ a fake device
class RecordingBus(ExpertBus):
    """A bus that crosses on the CPU: each copy a real copy (a new tensor), recorded; `drop` returns zeros on the way
    back (the negative control: the layer's output must come through the bus)."""

    def __init__(self, drop: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        self.sent: list[tuple[str, tuple[int, ...]]] = []
        self.drop = drop

    @property
    def crosses(self) -> bool:
        return True

    def copy_to_host(self, h: torch.Tensor) -> torch.Tensor:
        self.sent.append(("to_host", tuple(h.shape)))
        return h.clone()

    def copy_to_device(self, y: torch.Tensor) -> torch.Tensor:
        self.sent.append(("to_device", tuple(y.shape)))
        return torch.zeros_like(y) if self.drop else y.clone()


def _fit(runner: ModelRunner, bus: ExpertBus) -> None:
    for layer in runner.model.layers:
        if isinstance(layer.moe, HostExperts):
            layer.moe.bus = bus


def test_a_fake_device_sees_t_by_hidden_each_way_per_layer_and_nothing_else(mixed_folder: Path) -> None:
    want = _logits(_runner(mixed_folder, None))
    runner = _runner(mixed_folder, "all")
    bus = RecordingBus()
    _fit(runner, bus)
    got = _logits(runner)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    steps = [11, 16, 1, 1, 1]  # tokens of each forward: the two chunks, then three decodes
    hidden, layers = 64, 2
    expected = [(way, (t, hidden)) for t in steps for _ in range(layers) for way in ("to_host", "to_device")]
    assert bus.sent == expected  # per layer: h there, the output back; no router logits, ids or weights
    per_step = [bus_bytes(t, hidden, torch.float32, layers) for t in steps]
    assert bus.meter.to_host == sum(b["to_host"] for b in per_step) == 4 * hidden * layers * sum(steps)
    assert bus.meter.to_device == bus.meter.to_host and bus.meter.rows == layers * sum(steps)
    assert bus.meter.copies == len(expected)
    dropped = _runner(mixed_folder, "all")
    _fit(dropped, RecordingBus(drop=True))
    assert not torch.allclose(_logits(dropped), want)  # negative control: the experts' output comes over the bus


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("setting", [1, "all"])
def test_cuda_host_experts_match_the_cpu_reference(mixed_folder: Path, setting: Any) -> None:
    """float32 on CUDA, experts of the chosen layers on the host: logits = the CPU model's; the rest on the device;
    no CUDA graphs; the bus meter = the formula; forward_uses_host_cores."""
    want = _logits(_runner(mixed_folder, None))
    runner = _runner(mixed_folder, setting, device="cuda")
    assert not runner.cuda_graphs and runner.forward_uses_host_cores
    for i, layer in enumerate(runner.model.layers):
        assert layer.input_norm.device.type == "cuda"
        if layer.moe is not None:
            assert isinstance(layer.moe, HostExperts) == (i in runner.host_expert_layers)
            router = layer.moe.router.weight  # type: ignore[attr-defined]
            assert router.device.type == ("cpu" if i in runner.host_expert_layers else "cuda")
    torch.testing.assert_close(_logits(runner), want, rtol=1e-4, atol=1e-4)
    layers = len(runner.host_expert_layers)
    assert runner.stats_dict()["expert_bus_bytes"] == 2 * 4 * 64 * layers * 30  # 30 tokens, float32, both ways


@pytest.mark.cuda
@needs_cuda
def test_cuda_int8_host_experts_stay_quantized_while_the_device_dequantizes(mixed_folder: Path) -> None:
    from tandem.layers.kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("tandem's CPU kernels did not build on this machine: host experts would be dequantized")
    plain = _runner(mixed_folder, None, device="cuda", quantization="int8")
    runner = _runner(mixed_folder, 1, device="cuda", quantization="int8")
    host, device = runner.model.layers[0].moe, runner.model.layers[2].moe
    assert host is not None and device is not None
    assert {p.kind for e in host.experts for p in (e.gate_up, e.down)} == {"quant"}
    assert {p.kind for e in device.experts for p in (e.gate_up, e.down)} == {"dense"}
    torch.testing.assert_close(_logits(runner), _logits(plain), rtol=1e-3, atol=1e-3)
