"""Logits parity with the transformers reference on tiny random-weight models, through the real loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.models.loader import load_checkpoint
from tandem.runner.runner import ModelRunner
from tests.tiny import perturb_norms

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _tiny(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(**TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None))
    elif arch == "mistral-window":  # every layer sees the last 7 keys: parity past the window needs the window
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=7))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    elif arch == "qwen2-window":  # layer 0 full attention, layer 1 a window of 6 (max_window_layers)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                                                         max_window_layers=1))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=32))
    else:
        raise AssertionError(arch)
    return perturb_norms(model)


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3"])
def test_logits_match_transformers(arch: str, kernels: bool, tmp_path: Path) -> None:
    """30 positions: a prefill chunk, a chunk over the cache, decodes (past the window for the windowed models)."""
    ref = _tiny(arch)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(tmp_path, torch.float32, progress=False)
    runner = ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=4, num_blocks=16),
                         SchedulerConfig(max_model_len=64), use_kernels=kernels)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]  # [30, V]
    table = list(range(8))
    tok = ids[0].tolist()
    got = [
        runner.execute(StepPlan(0, [ScheduledRequest("a", tok[:11], 0, table, all_logits=True)])),  # prefill chunk 1
        runner.execute(StepPlan(1, [ScheduledRequest("a", tok[11:27], 11, table, all_logits=True)])),  # chunk over cache
    ]
    for p in range(27, 30):  # decode
        got.append(runner.execute(StepPlan(2, [ScheduledRequest("a", [tok[p]], p, table)])))
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral-window"])
def test_batched_decode_and_verify_rows_match_transformers(arch: str, kernels: bool, tmp_path: Path) -> None:
    """Several requests in one step: a prefill, plain decodes and a multi-token (speculative) chunk."""
    ref = _tiny(arch)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(tmp_path, torch.float32, progress=False)
    runner = ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=4, num_blocks=64),
                         SchedulerConfig(max_model_len=64), use_kernels=kernels)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 21)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    # step 1: prefill all but the last 3 tokens of each
    runner.execute(StepPlan(0, [ScheduledRequest(str(i), s[:-3], 0, tables[i]) for i, s in enumerate(seqs)]))
    # step 2: request 0 decodes one token, request 1 verifies 3 tokens (1 + 2 drafts), request 2 decodes one
    plan = StepPlan(1, [
        ScheduledRequest("0", [seqs[0][-3]], len(seqs[0]) - 3, tables[0]),
        ScheduledRequest("1", seqs[1][-3:], len(seqs[1]) - 3, tables[1], num_draft_tokens=2),
        ScheduledRequest("2", [seqs[2][-3]], len(seqs[2]) - 3, tables[2]),
    ])
    logits = runner.execute(plan)  # [1 + 3 + 1, V]
    with torch.no_grad():
        exp = [ref(torch.tensor([s])).logits[0] for s in seqs]
    torch.testing.assert_close(logits[0], exp[0][-3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1:4], exp[1][-3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[4], exp[2][-3], rtol=1e-4, atol=1e-4)


def test_bfloat16_close_to_float32(tmp_path: Path) -> None:
    ref = _tiny("llama")
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ids = list(range(1, 20))
    outs = []
    for dt in (torch.float32, torch.bfloat16):
        ckpt = load_checkpoint(tmp_path, dt, progress=False)
        runner = ModelRunner(ckpt.config, ckpt.weights, dt, "cpu", CacheConfig(block_size=4, num_blocks=8),
                             SchedulerConfig(max_model_len=64))
        outs.append(runner.execute(StepPlan(0, [ScheduledRequest("a", ids, 0, list(range(5)))])))
    assert (outs[0] - outs[1]).abs().max() < 0.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/device_check.sh there)")
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "mistral-window", "qwen2-window"])
def test_cuda_logits_match_cpu_reference(arch: str, tmp_path: Path) -> None:
    """The same checks on the accelerator: pinned buffers, non-blocking copies, SDPA's fused kernels."""
    ref = _tiny(arch)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(tmp_path, torch.float32, progress=False)
    runner = ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cuda", CacheConfig(block_size=4, num_blocks=16),
                         SchedulerConfig(max_model_len=64))
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    tok, table = ids[0].tolist(), list(range(8))
    got = [runner.execute(StepPlan(0, [ScheduledRequest("a", tok[:12], 0, table, all_logits=True)])).cpu()]
    for p in range(12, 20):
        got.append(runner.execute(StepPlan(1, [ScheduledRequest("a", [tok[p]], p, table)])).cpu())
    torch.testing.assert_close(torch.cat(got), expected, rtol=2e-3, atol=2e-3)
