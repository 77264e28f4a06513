"""The decode stack (csrc/decode_stack.cpp): decode and verify steps as one C++ call give the Python layer loop's
logits to the bit, for every dense family it takes (biases, q / k norms, sliding windows), bf16 GEMM and quantized
projections, mixtures of quantized experts (Qwen3-MoE, Mixtral, gpt-oss), one or several requests and several queries a
request; it is not built where a part has no C++ call (torch operations, bf16 experts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.decode_stack import ENV
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import quant_isa
from tandem.models.gguf_writer import write_gguf
from tandem.models.loader import load_checkpoint
from tandem.models.shapes import ModelShape, random_weights
from tandem.runner.runner import ModelRunner

needs_kernels = pytest.mark.skipif(not load_cpu_kernels(), reason="no tandem CPU kernels here")
SHAPE = ModelShape("tiny-q", "llama", 256, 512, 2, 4, 2, 384, True, 10000.0, 128)
BLOCKS = 32


def _runner(path: Path, dtype: torch.dtype, stack: bool, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    monkeypatch.setenv(ENV, "1" if stack else "0")
    ckpt = load_checkpoint(path, dtype, progress=False)
    return ModelRunner(ckpt.config, ckpt.weights, dtype, "cpu", CacheConfig(block_size=4, num_blocks=BLOCKS),
                       SchedulerConfig(max_model_len=96), num_threads=1)


def _steps(runner: ModelRunner, vocab: int) -> torch.Tensor:
    """Logits of: two prefills, decode steps of both requests together, then a verify step of 4 queries for one and
    1 for the other (the rows speculation sends), then one request alone."""
    g = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(1, vocab, (30,), generator=g).tolist() for r in "ab"}
    blocks = {"a": list(range(0, 16)), "b": list(range(16, 32))}
    out = [runner.execute(StepPlan(0, [ScheduledRequest(r, ids[r][:9], 0, blocks[r], all_logits=True) for r in "ab"]))]
    n = 9
    for step in range(1, 6):
        out.append(runner.execute(StepPlan(step, [ScheduledRequest(r, [ids[r][n]], n, blocks[r]) for r in "ab"])))
        n += 1
    verify = [ScheduledRequest("a", ids["a"][n : n + 4], n, blocks["a"], all_logits=True),
              ScheduledRequest("b", [ids["b"][n]], n, blocks["b"])]
    out.append(runner.execute(StepPlan(6, verify)))
    out.append(runner.execute(StepPlan(7, [ScheduledRequest("a", [ids["a"][n + 4]], n + 4, blocks["a"])])))
    return torch.cat(out)


def _same_with_and_without(path: Path, dtype: torch.dtype, vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    loop, stacked = (_runner(path, dtype, s, monkeypatch) for s in (False, True))
    assert loop.model.decode_stack is None
    if stacked.model.decode_stack is None:
        pytest.skip("a projection of this model has no C++ kernel call on this CPU")
    assert torch.equal(_steps(stacked, vocab), _steps(loop, vocab))


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral-window", "qwen2", "qwen2-window", "qwen3"])
def test_bf16_model_decodes_as_the_python_loop(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.models.test_parity import _tiny

    _tiny(arch).save_pretrained(tmp_path, safe_serialization=True)
    _same_with_and_without(tmp_path, torch.bfloat16, 128, monkeypatch)


@pytest.mark.skipif(quant_isa() == 0, reason="no quantized CPU kernels here")
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_quantized_model_decodes_as_the_python_loop(file_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / f"t.{file_type}.gguf", SHAPE, random_weights(SHAPE, seed=1), file_type, None)
    for dtype in (torch.float32, torch.bfloat16):
        _same_with_and_without(path, dtype, SHAPE.vocab, monkeypatch)


@pytest.mark.skipif(quant_isa() == 0, reason="no quantized CPU kernels here")
@pytest.mark.parametrize(("family", "file_type"), [("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K_M"), ("mixtral", "Q4_K_M"),
                                                  ("gpt-oss", "MXFP4_MOE")])
def test_quantized_experts_decode_as_the_python_loop(family: str, file_type: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixture of experts in the stack (moe_route, the grouped expert calls, moe_combine; gpt-oss: expert and
    router biases, its clamped SwiGLU, sinks, sliding windows): two requests routed to different experts in one step,
    and a verify step, give the Python loop's logits to the bit."""
    from tests.models.test_moe_gguf import TINY_SHAPES, write_tiny_moe

    path = write_tiny_moe(tmp_path, family, file_type)
    for dtype in (torch.float32, torch.bfloat16):
        _same_with_and_without(path, dtype, TINY_SHAPES[family].vocab, monkeypatch)
    assert _runner(path, torch.float32, True, monkeypatch).model.decode_stack is not None


@needs_kernels
def test_no_stack_without_the_kernels_or_for_bf16_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.models.test_moe import _tiny_moe
    from tests.models.test_parity import _tiny

    _tiny("llama").save_pretrained(tmp_path / "dense", safe_serialization=True)
    ckpt = load_checkpoint(tmp_path / "dense", torch.bfloat16, progress=False)
    torch_ops = ModelRunner(ckpt.config, ckpt.weights, torch.bfloat16, "cpu", CacheConfig(block_size=4, num_blocks=8),
                            SchedulerConfig(max_model_len=32), num_threads=1, use_kernels=False)
    assert torch_ops.model.decode_stack is None
    _tiny_moe("qwen3-moe").save_pretrained(tmp_path / "moe", safe_serialization=True)
    moe = load_checkpoint(tmp_path / "moe", torch.bfloat16, progress=False)
    runner = ModelRunner(moe.config, moe.weights, torch.bfloat16, "cpu", CacheConfig(block_size=4, num_blocks=8),
                         SchedulerConfig(max_model_len=32), num_threads=1)
    assert runner.model.decode_stack is None


def test_the_switch_reads_its_values_and_names_a_bad_one(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from tandem.layers.decode_stack import stack_wanted

    monkeypatch.delenv(ENV, raising=False)
    assert stack_wanted() is True  # on by default
    for value, on in (("1", True), ("on", True), ("0", False), ("OFF", False), ("false", False)):
        monkeypatch.setenv(ENV, value)
        assert stack_wanted() is on, value
    monkeypatch.setenv(ENV, "maybe")
    assert stack_wanted() is True
    assert "TANDEM_DECODE_STACK='maybe'" in caplog.text
