"""Whole models with quantized weights: int8 from safetensors reproduces a real model's greedy text, GGUF quant types
kept quantized track the dequantized model, and the AVX2 path gives the VNNI path's logits to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.linear import ISA_ENV, quant_isa
from tandem.models.gguf_writer import write_gguf
from tandem.models.loader import load_checkpoint
from tandem.models.shapes import ModelShape, random_weights
from tandem.runner.runner import ModelRunner
from tests.conftest import STORIES_GREEDY

needs_kernels = pytest.mark.skipif(quant_isa() == 0, reason="no quantized CPU kernels here")
SHAPE = ModelShape("tiny-q", "llama", 256, 512, 2, 4, 2, 384, True, 10000.0, 128)


@needs_kernels
def test_int8_safetensors_model_keeps_the_greedy_story(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    from tandem.params import SamplingParams

    engine = stories_engine_factory(quantization="int8")
    kinds = {type(p).__name__ for la in engine.runner.model.layers for p in (la.qkv, la.o, la.gate_up, la.down)}
    assert "QuantProjection" in kinds  # K = 64 projections run int8; the 172-wide down projection stays dense
    engine.add_request("s", [1], SamplingParams(temperature=0.0, max_tokens=60))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    assert text == STORIES_GREEDY
    engine.shutdown()


def _logits(path: Path, quantization: str | None) -> torch.Tensor:
    ckpt = load_checkpoint(path, torch.float32, progress=False, quantization=quantization)
    runner = ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=16, num_blocks=8),
                         SchedulerConfig(max_model_len=128))
    ids = torch.randint(0, SHAPE.vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = runner.execute(StepPlan(0, [ScheduledRequest("a", ids[:32], 0, list(range(4)), all_logits=True)]))
    decode = [runner.execute(StepPlan(1, [ScheduledRequest("a", [t], 32 + i, list(range(4)))])) for i, t in enumerate(ids[32:])]
    return torch.cat([prefill, *decode])


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("q")
    return {ft: write_gguf(folder / f"t.{ft}.gguf", SHAPE, random_weights(SHAPE, seed=1), ft, None)
            for ft in ("Q8_0", "Q4_0", "Q4_K_M")}


@needs_kernels
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_quantized_gguf_tracks_its_dequantized_model(tiny_ggufs: dict[str, Path], file_type: str) -> None:
    """Prefill and decode rows: kept quantized (int8 activation blocks) vs the same file dequantized to float32."""
    kept, dense = _logits(tiny_ggufs[file_type], None), _logits(tiny_ggufs[file_type], "none")
    err = (kept - dense).norm() / dense.norm()
    assert float(err) < 0.02, float(err)


@needs_kernels
def test_avx2_fallback_gives_the_vnni_logits(tiny_ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    if quant_isa() < 2:
        pytest.skip("needs AVX512-VNNI to compare with")
    vnni = _logits(tiny_ggufs["Q4_K_M"], None)
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert quant_isa() == 1
    assert torch.equal(_logits(tiny_ggufs["Q4_K_M"], None), vnni)
