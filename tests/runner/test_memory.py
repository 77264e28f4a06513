"""Memory that fits: weights resident once after load (no file mapping or second copy kept), a KV cache sized to the
work and committed only where written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.runner.memory import huge_page_zeros, resident_bytes, resident_range_bytes
from tandem.runner.runner import kv_block_bytes, plan_kv_cache

CFG = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 4096,
})
CPU = torch.device("cpu")


def test_kv_cache_is_sized_to_the_work() -> None:
    per_block = kv_block_bytes(CFG, 16, torch.bfloat16)
    plan = plan_kv_cache(CFG, CacheConfig(), SchedulerConfig(max_num_seqs=8, max_model_len=1000), torch.bfloat16, CPU)
    assert plan.num_blocks == 8 * (-(-1000 // 16) + 1)  # every request at full length, one spare block each
    assert plan.nbytes == plan.num_blocks * per_block and "max_num_seqs 8 x max_model_len 1000" in plan.describe()


def test_kv_cache_is_capped_by_the_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.runner.runner as runner

    monkeypatch.setattr(runner, "available_memory", lambda device: 1000 * kv_block_bytes(CFG, 16, torch.bfloat16))
    plan = plan_kv_cache(CFG, CacheConfig(memory_fraction=0.1), SchedulerConfig(max_num_seqs=64, max_model_len=4096),
                         torch.bfloat16, CPU)
    assert plan.num_blocks == 100 and "capped at memory_fraction 0.1" in plan.reason
    half = plan_kv_cache(CFG, CacheConfig(memory_fraction=0.1, share=0.5), SchedulerConfig(max_num_seqs=64, max_model_len=4096),
                         torch.bfloat16, CPU)
    assert half.num_blocks == 50  # a data-parallel replica's share of the host


def test_host_default_kv_pool_is_capped_at_4_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a size or a fraction the host pool stops at HOST_KV_DEFAULT (vLLM's CPU default), however much memory
    is free; an explicit fraction lifts it, and an accelerator keeps half of its free memory."""
    import tandem.runner.runner as runner

    monkeypatch.setattr(runner, "available_memory", lambda device: 64 << 30)
    big = SchedulerConfig(max_num_seqs=8192, max_model_len=4096)  # 64 GiB of work
    per_block = kv_block_bytes(CFG, 16, torch.bfloat16)
    plan = plan_kv_cache(CFG, CacheConfig(), big, torch.bfloat16, CPU)
    assert plan.num_blocks == runner.HOST_KV_DEFAULT // per_block and "host default 4.00 GiB" in plan.describe()
    assert plan_kv_cache(CFG, CacheConfig(share=0.5), big, torch.bfloat16, CPU).num_blocks == plan.num_blocks // 2
    assert plan_kv_cache(CFG, CacheConfig(memory_fraction=0.5), big, torch.bfloat16, CPU).num_blocks == (32 << 30) // per_block
    assert plan_kv_cache(CFG, CacheConfig(), big, torch.bfloat16, torch.device("meta")).num_blocks == (32 << 30) // per_block


def test_explicit_kv_size_wins() -> None:
    sched = SchedulerConfig(max_num_seqs=1, max_model_len=64)
    per_block = kv_block_bytes(CFG, 16, torch.bfloat16)
    by_bytes = plan_kv_cache(CFG, CacheConfig(kv_cache_memory=50 * per_block), sched, torch.bfloat16, CPU)
    assert by_bytes.num_blocks == 50  # not capped by the (small) work: a prefix cache can use the rest
    assert plan_kv_cache(CFG, CacheConfig(num_blocks=7), sched, torch.bfloat16, CPU).num_blocks == 7
    with pytest.raises(ConfigError, match="holds no block"):
        plan_kv_cache(CFG, CacheConfig(kv_cache_memory=per_block - 1), sched, torch.bfloat16, CPU)


def test_host_kv_memory_is_committed_where_written() -> None:
    before, _ = resident_bytes()
    cache = huge_page_zeros((2, 64, 8, 16, 128), torch.float32)  # 128 MiB
    allocated, _ = resident_bytes()
    assert allocated - before < 16 << 20 and float(cache.abs().sum()) == 0.0  # zero, and reading commits nothing
    cache[0, :4].fill_(1.0)  # 256 KiB: at most one 2 MiB page per 2 MiB touched
    touched, _ = resident_bytes()
    assert touched - before < 24 << 20
    assert cache.data_ptr() % (2 << 20) == 0


def test_resident_bytes_of_a_host_kv_cache_follow_its_written_blocks() -> None:
    cache = huge_page_zeros((2, 64, 8, 16, 128), torch.float32)  # 128 MiB, block-major: 64 KiB per block and K/V
    assert resident_range_bytes(cache) == 0
    cache[:, :8].fill_(1.0)  # 8 blocks of K and of V: 1 MiB written
    measured = resident_range_bytes(cache)
    assert measured is not None and 1 << 20 <= measured <= 4 << 20  # K's and V's part each at most one 2 MiB page


def _write_model(folder: Path, layers: int = 4, hidden: int = 512, vocab: int = 8192) -> int:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": 8,
           "num_key_value_heads": 8, "vocab_size": vocab, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
                                  "model.norm.weight": torch.ones(hidden).bfloat16(),
                                  "lm_head.weight": torch.randn(vocab, hidden, generator=g).bfloat16()}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
              p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16()}
        w |= {p + f"self_attn.{x}_proj.weight": torch.randn(hidden, hidden, generator=g).bfloat16() for x in "qkvo"}
        w |= {p + f"mlp.{x}_proj.weight": torch.randn(4 * hidden, hidden, generator=g).bfloat16() for x in ("gate", "up")}
        w[p + "mlp.down_proj.weight"] = torch.randn(hidden, 4 * hidden, generator=g).bfloat16()
    save_file(w, str(folder / "model.safetensors"))
    return sum(t.numel() * 2 for t in w.values())


def _measure_load(folder: str, quantization: str | None) -> dict[str, int | bool]:
    """In a fresh process: RSS before / after building the runner, its peak, the weights' bytes, and whether any
    mapping of the checkpoint file is left."""
    from tandem.models.loader import load_checkpoint
    from tandem.runner.runner import ModelRunner

    before, _ = resident_bytes()
    ckpt = load_checkpoint(folder, torch.bfloat16, quantization=quantization)
    runner = ModelRunner(ckpt.config, ckpt.weights, torch.bfloat16, "cpu", CacheConfig(num_blocks=4),
                         SchedulerConfig(max_model_len=64))
    del ckpt
    after, peak = resident_bytes()
    maps = Path("/proc/self/maps").read_text()
    return {"before": before, "after": after, "peak": peak, "weights": runner.weight_bytes,
            "mapped": "model.safetensors" in maps}


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_weights_are_resident_once(tmp_path: Path, quantization: str | None) -> None:
    from tandem.bench.peers import in_subprocess

    file_bytes = _write_model(tmp_path / "m")  # ~60 MB of bf16
    m = in_subprocess(_measure_load, str(tmp_path / "m"), quantization)
    assert not m["mapped"]
    expected = file_bytes if quantization is None else file_bytes // 2
    assert abs(int(m["weights"]) - expected) < 0.05 * expected
    added = int(m["after"]) - int(m["before"])
    slack = 40 << 20  # kernels, oneDNN / allocator arenas: a constant, not a copy of the weights
    assert added < 1.1 * int(m["weights"]) + slack, (added, m)
    assert int(m["peak"]) - int(m["before"]) < 1.2 * int(m["weights"]) + 2 * slack, m
