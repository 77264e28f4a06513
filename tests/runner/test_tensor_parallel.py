"""Tensor parallelism on the CPU over gloo: TP=2 gives TP=1's greedy float32 tokens (tiny models, the demo model with
structured outputs and n-gram speculation), and the bytes each rank hands to the collectives per step are the
formula's (`runner/distributed.py: step_bytes`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.parallel import TensorParallel, even_split
from tandem.layers.quant import quantize_int8
from tandem.models.sharding import WeightShard, slice_weight
from tandem.runner.distributed import (
    TensorParallelRunner,
    WorkerSpec,
    decode_plan,
    encode_plan,
    rank_cores,
    step_bytes,
)
from tests.layers.test_quant import random_blocks
from tests.tiny import save_tiny, tiny_model

PROMPTS = ["t1 t2 t3 t4", "t5 t9 t20 t30 t31 t40 t41 t42 t43 t44 t45 t46 t47 t48 t49 t50 t51 t52", "t7"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tokens(model: str, tp: int, prompts: list[str], params: SamplingParams | list[SamplingParams], **kw: Any) -> list[list[int]]:
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=4 << 20, progress=False, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q/k/v and o biases, 3 kv heads, an odd vocabulary and intermediate size: every split is uneven at TP=2."""
    model = tiny_model("llama", attention_bias=True, vocab_size=125, hidden_size=96, intermediate_size=90, num_attention_heads=6,
                       num_key_value_heads=3, eos_token_id=124)
    return save_tiny(tmp_path_factory.mktemp("tiny-uneven"), model)


def test_even_split_covers_everything_once() -> None:
    for n, parts in [(9, 2), (3, 2), (125, 2), (1536, 3), (8, 8)]:
        spans = [even_split(n, parts, i) for i in range(parts)]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1
    assert rank_cores((0, 1, 2, 3), 2, 1) == (2, 3)
    assert rank_cores((0,), 2, 1) == (0,)  # fewer cores than ranks: everyone shares


def test_plan_survives_the_wire() -> None:
    plan = StepPlan(7, [ScheduledRequest("a", [5, 6, 7], 30, [4, 9, 11, 12], 2), ScheduledRequest("b", [1], 0, [3], 0, False, True)])
    back = decode_plan(encode_plan(plan, 16))
    assert back.step_id == 7
    assert [(r.input_ids, r.start_pos, r.block_table, r.num_draft_tokens, r.needs_logits, r.all_logits) for r in back.requests] == [
        ([5, 6, 7], 30, [4, 9, 11], 2, True, False), ([1], 0, [3], 0, False, True)]  # only the blocks in use travel


def test_shards_rebuild_the_weights() -> None:
    cfg = ModelConfig(family="llama", vocab_size=11, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=6,
                      num_kv_heads=3, head_dim=4)
    names = {"model.layers.0.self_attn.q_proj.weight": (24, 8), "model.layers.0.self_attn.k_proj.weight": (12, 8),
             "model.layers.0.self_attn.o_proj.weight": (8, 24), "model.layers.0.mlp.down_proj.weight": (8, 6),
             "model.embed_tokens.weight": (11, 8), "model.norm.weight": (8,)}
    for name, shape in names.items():
        w = torch.randn(shape)
        parts = [WeightShard(cfg, TensorParallel(r, 2)).cut(name, w) for r in range(2)]
        dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
        expect = w if name.endswith("norm.weight") else torch.cat(parts, dim=dim)  # type: ignore[arg-type]
        assert torch.equal(expect, w) and all(isinstance(p, torch.Tensor) for p in parts)
    q = quantize_int8(torch.randn(8, 64))
    assert torch.equal(slice_weight(q, 1, 32, 64).dequantize(), q.dequantize()[:, 32:])  # type: ignore[union-attr]
    assert torch.equal(slice_weight(q, 0, 2, 5).dequantize(), q.dequantize()[2:5])  # type: ignore[union-attr]
    # a draft's restricted output projection (ModelConfig.output_rows) is its first rows, GGUF blocks and I8 alike
    for w in (random_blocks("Q4_K", 37, 512), random_blocks("Q8_0", 37, 512), quantize_int8(torch.randn(37, 96))):
        head = slice_weight(w, 0, 0, 20)
        assert head.shape == (20, w.shape[1]) and torch.equal(head.dequantize(), w.dequantize()[:20])  # type: ignore[union-attr]


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_tp2_greedy_tokens_match_tp1_tiny(tmp_path: Path, kernels: bool) -> None:
    folder = str(save_tiny(tmp_path / "tiny", tiny_model("llama")))
    one = _tokens(folder, 1, PROMPTS, GREEDY, cpu_kernels=kernels)
    assert _tokens(folder, 2, PROMPTS, GREEDY, cpu_kernels=kernels) == one


def test_tp2_uneven_split_matches_tp1_and_bytes_per_step_equal_the_formula(tiny_uneven: Path) -> None:
    one = _tokens(str(tiny_uneven), 1, PROMPTS, GREEDY)
    llm = LLM(str(tiny_uneven), dtype="float32", tensor_parallel_size=2, kv_cache_memory=4 << 20, progress=False)
    try:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == one
        _check_bytes_per_step(llm)
    finally:
        llm.shutdown()


def _check_bytes_per_step(llm: LLM) -> None:
    runner = llm.llm_engine.runner
    assert isinstance(runner, TensorParallelRunner)
    cfg = llm.llm_engine.config.model_config
    plans = [
        StepPlan(1, [ScheduledRequest("p", list(range(1, 40)), 0, [0, 1, 2])]),  # a prefill
        StepPlan(2, [ScheduledRequest("d", [5], 39, [0, 1, 2]), ScheduledRequest("v", [1, 2, 3, 4], 20, [3, 4], 3)]),  # decode + verify
    ]
    for plan in plans:
        runner.tp.meter.reset()
        logits = runner.execute(plan)
        assert logits.shape == (plan.num_logits_rows, cfg.vocab_size)
        expected = step_bytes(plan, cfg, torch.float32, 2, runner.block_size)
        assert dict(runner.tp.meter.bytes_by_op) == expected
        assert runner.tp.meter.calls_by_op["all_reduce"] == 2 * cfg.num_layers


def test_tp2_demo_model_structured_and_ngram_match_tp1(demo_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompts = ["Give me a JSON person record:", "The capital of France is Paris. The capital of France is"]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=16, temperature=0.0)]
    kw: dict[str, Any] = dict(max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    one = _tokens(str(demo_model_dir), 1, prompts, params, **kw)
    llm = LLM(str(demo_model_dir), dtype="float32", tensor_parallel_size=2, kv_cache_memory=4 << 20, progress=False, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == one
    assert stats["tp_size"] == 2 and stats["tp_bytes_all_reduce"] > 0
    assert any(v > 0 for k, v in stats.items() if "draft" in k and isinstance(v, (int, float)))  # speculation ran
    if outs[0].outputs[0].finish_reason == "stop":  # finished inside the budget: the schema's JSON
        assert {"name", "age"} <= set(json.loads(outs[0].outputs[0].text))


def test_more_ranks_than_kv_heads_replicate_each_kv_head() -> None:
    """6 query heads over 2 kv heads at TP=4: ranks 0-1 hold kv head 0, ranks 2-3 kv head 1; each kv head's 3 query
    heads are split 2 + 1 among its ranks; the query shards still rebuild q, the k shards repeat per replica."""
    cfg = ModelConfig(family="llama", vocab_size=11, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=6,
                      num_kv_heads=2, head_dim=4)
    ranks = [TensorParallel(r, 4) for r in range(4)]
    assert [tp.kv_heads(cfg) for tp in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [tp.q_heads(cfg) for tp in ranks] == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert {tp.shard_config(cfg).num_kv_heads for tp in ranks} == {1}
    q, k = torch.randn(24, 8), torch.randn(8, 8)
    assert torch.equal(torch.cat([WeightShard(cfg, tp).cut("l.q_proj.weight", q) for tp in ranks]), q)  # type: ignore[list-item]
    ks = [WeightShard(cfg, tp).cut("l.k_proj.weight", k) for tp in ranks]
    assert torch.equal(ks[0], k[:4]) and torch.equal(ks[1], k[:4]) and torch.equal(ks[3], k[4:])  # type: ignore[arg-type]
    for bad in (3, 8):  # not a multiple of the kv heads; more ranks than query heads
        with pytest.raises(ConfigError, match="kv heads"):
            TensorParallel(0, bad).kv_heads(cfg)


def test_tp4_with_2_kv_heads_matches_tp1(tmp_path: Path) -> None:
    """kv-head replication end to end: 4 ranks over gloo, 6 query heads on 2 kv heads (uneven query split), biases."""
    model = tiny_model("llama", attention_bias=True, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    folder = str(save_tiny(tmp_path / "tiny-gqa", model))
    one = _tokens(folder, 1, PROMPTS, GREEDY)
    assert _tokens(folder, 4, PROMPTS, GREEDY) == one


def test_tp2_on_a_local_ray_cluster_matches_tp1(tmp_path: Path) -> None:
    """The same worker code placed by Ray (skipped where Ray is not installed: it is optional)."""
    ray = pytest.importorskip("ray")
    folder = str(save_tiny(tmp_path / "tiny", tiny_model("llama")))
    one = _tokens(folder, 1, PROMPTS, GREEDY)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert _tokens(folder, 2, PROMPTS, GREEDY, distributed_executor_backend="ray") == one
    finally:
        ray.shutdown()


def test_ray_reserves_rank_0s_gpu_before_placing_the_workers() -> None:
    """A driver outside Ray (rank 0 in the API server's engine) holds a GPU in Ray's books before any rank actor is
    placed, so Ray gives every worker another GPU (a local cluster with 2 logical GPUs; nothing touches CUDA)."""
    ray = pytest.importorskip("ray")
    from tandem.runner.ray_launcher import RayLauncher, visible_index

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        launcher = RayLauncher()
        driver = launcher.driver_device(torch.device("cuda"))

        @ray.remote(num_cpus=0, num_gpus=1)
        def worker_gpu() -> str:
            return str(ray.get_gpu_ids()[0])

        assert driver.type == "cuda" and {str(driver.index), ray.get(worker_gpu.remote())} == {"0", "1"}
        launcher.stop()  # the hold goes with the group
        assert launcher.hold is None and ray.get(worker_gpu.remote()) in ("0", "1")
    finally:
        ray.shutdown()
    assert visible_index("3", None) == 3 and visible_index("3", "2,3") == 1


def test_a_rank_that_sees_only_its_own_gpu_runs_on_cuda_0() -> None:
    """A local worker counts up from the driver's device; a Ray actor sees only the GPU Ray gave it, as cuda:0."""
    spec = WorkerSpec(model_path="m", dtype="bfloat16", quantization=None, device="cuda:2", cache=CacheConfig(),
                      scheduler=SchedulerConfig(), use_kernels=False, rank=1, size=2, init_method="", cores=(0,),
                      num_threads=1)
    assert spec.rank_device == torch.device("cuda", 3)
    assert dataclasses.replace(spec, sees_own_gpu=True).rank_device == torch.device("cuda", 0)
    assert dataclasses.replace(spec, device="cpu", sees_own_gpu=True).rank_device == torch.device("cpu")
