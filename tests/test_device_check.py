"""The device check's dry run on this CPU (tiny sizes, the same code as on the lent accelerator), so that it cannot
rot between loans: every section runs, every parity check passes, the report and its JSON are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.bench import device_check


def test_device_check_dry_run_on_cpu(tmp_path: Path, shared_data: Path) -> None:
    pytest.importorskip("xgrammar")
    code = device_check.main(["--device", "cpu", "--out", str(tmp_path), "--tokenizer", str(shared_data / "tokenizers" / "gpt2")])
    results = json.loads((tmp_path / "device_check.json").read_text())
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    assert [r["check"] for r in results["parity"]] == ["bitmask", "sampler", "verification", "model logits (float32)"]
    assert all(r["ok"] for r in results["parity"])
    assert results["decode"]["batch_1"]["out_tokens"] > 0 and results["guided"]["guided"]["out_tokens"] > 0
    assert results["launches"]["aten_ops_per_step"] > 0
    assert results["environment"]["decode_attention"] == "flex (paged)"  # the CUDA path's code, run on the host
    assert results["decode"]["graphs"]["graph_steps"] > 0
    moe = results["moe_host_experts"]  # the CPU device: the experts' hop copies nothing, the tokens are the same
    assert moe["tokens"]["identical"] == moe["tokens"]["requests"] == 5
    assert moe["on_host"]["batch_4"]["tok_s"] > 0 and moe["on_host"]["batch_4"]["bus_copies"] == 0
    assert moe["on_host"]["host_expert_kernels"] and not moe["on_device"]["host_expert_kernels"]
    assert code == 0 and results["ok"]
    assert (tmp_path / "device_check.md").read_text().startswith("# tandem device check: PASS")


def test_padded_tokenizer_decodes_every_model_id(tmp_path: Path, shared_data: Path) -> None:
    from tandem.tokenizer import Tokenizer

    folder = device_check.padded_tokenizer(shared_data / "tokenizers" / "gpt2", 50304, tmp_path)
    tok = Tokenizer.from_path(folder)
    assert tok.vocab_size == 50304
    assert tok.hf.decode([50303]) == "<unused50303>"


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
def test_parity_checks_at_batch_8(device: str) -> None:
    """The device check's parity rows as a test: bitmask (Triton on CUDA), sampler, verification, model logits
    (bf16 on CUDA: paged decode attention, CUDA graphs) against the CPU reference."""
    from dataclasses import replace

    from tandem.bench.device_parity import run_parity
    from tandem.config import ModelConfig

    shape = replace(device_check.TINY, vocab=1000)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = run_parity(torch.device(device), shape.vocab, ModelConfig.from_hf(shape.hf_config()),
                      lambda d, dt: device_check.random_weights(shape, d, dt, seed=1), dtype)
    assert [r["check"] for r in rows][:3] == ["bitmask", "sampler", "verification"]
    assert all(r["ok"] for r in rows), rows
