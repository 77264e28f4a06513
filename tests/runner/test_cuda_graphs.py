"""CUDA graphs for decode and verification steps: bucket choice, which steps qualify, padding into the static
buffers, capture once per (bucket, q) and replay after. On the host the capture is an eager stand-in (the same
bookkeeping, the step rerun into the static output); on CUDA the real graphs' logits must equal the eager ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.bench.device_check import TINY, random_weights
from tandem.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.plan_arrays import plan_rows
from tandem.layers.paged_decode import flex_available
from tandem.runner.cuda_graphs import EagerGraph, bucket_for, graph_query_len
from tandem.runner.runner import ModelRunner

SHAPE = replace(TINY, vocab=96)
BS = 4


def test_bucket_for() -> None:
    assert [bucket_for(n, 1) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert bucket_for(257, 1) is None
    assert bucket_for(64, 16) == 64 and bucket_for(65, 16) is None  # 128 x 16 tokens: too big a graph


def test_which_steps_qualify() -> None:
    decode = [ScheduledRequest(str(i), [1], 5 + i, [0, 1]) for i in range(3)]
    assert graph_query_len(StepPlan(0, decode)) == 1
    verify = [ScheduledRequest(str(i), [1, 2, 3], 5, [0, 1, 2], num_draft_tokens=2) for i in range(2)]
    assert graph_query_len(StepPlan(0, verify)) == 3
    mixed_k = verify[:1] + [ScheduledRequest("x", [1, 2], 5, [0, 1], num_draft_tokens=1)]
    assert graph_query_len(StepPlan(0, mixed_k)) is None
    assert graph_query_len(StepPlan(0, [ScheduledRequest("p", [1, 2, 3], 0, [0])])) is None  # a prefill
    chunk = ScheduledRequest("c", [1, 2, 3], 4, [0, 1])  # a prefill chunk wants one row, not three
    assert graph_query_len(StepPlan(0, [chunk])) is None
    assert graph_query_len(StepPlan(0, [])) is None


def _runner(device: str, dtype: torch.dtype, graphs: bool, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """Blocks of 4 on the host; of 16 on CUDA (the compiled kernels' smallest), max_model_len so that the tables
    of 8 blocks fit a graph either way."""
    monkeypatch.setenv("TANDEM_DECODE_ATTENTION", "paged")
    cfg = ModelConfig.from_hf(SHAPE.hf_config())
    bs, max_len = (16, 128) if device == "cuda" else (BS, 32)
    return ModelRunner(cfg, random_weights(SHAPE, torch.device(device), dtype, seed=2), dtype, device,
                       CacheConfig(block_size=bs, num_blocks=40), SchedulerConfig(max_num_seqs=4, max_model_len=max_len),
                       use_kernels=False, cuda_graphs=graphs)


def _steps() -> list[StepPlan]:
    """Prefills of 3 requests, 2 decode steps (bucket 4), a verification of 2 drafts each (bucket 4, q 3), a decode
    of 2 of them (bucket 2), a mixed step (eager)."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    lens = [5, 9, 14]
    steps = [StepPlan(0, [ScheduledRequest(str(i), [7 + i] * n, 0, tables[i]) for i, n in enumerate(lens)])]
    for s in range(2):
        steps.append(StepPlan(1 + s, [ScheduledRequest(str(i), [11 + s], n + s, tables[i]) for i, n in enumerate(lens)]))
    steps.append(StepPlan(3, [ScheduledRequest(str(i), [3, 4, 5], n + 2, tables[i], num_draft_tokens=2) for i, n in enumerate(lens)]))
    steps.append(StepPlan(4, [ScheduledRequest(str(i), [6], lens[i] + 5, tables[i]) for i in (0, 2)]))
    steps.append(StepPlan(5, [ScheduledRequest("0", [8], lens[0] + 6, tables[0]), ScheduledRequest("3", [1] * 6, 0, [30, 31])]))
    return steps


def _run_both(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelRunner, list[tuple[torch.Tensor, torch.Tensor]]]:
    eager = _runner(device, dtype, graphs=False, monkeypatch=monkeypatch)
    graphed = _runner(device, dtype, graphs=True, monkeypatch=monkeypatch)
    pairs = [(graphed.execute(plan).float().cpu(), eager.execute(plan).float().cpu()) for plan in _steps()]
    return graphed, pairs


@pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")
def test_graphed_steps_match_eager_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, pairs = _run_both("cpu", torch.float32, monkeypatch)
    for got, want in pairs:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = graphed._graphs
    assert g is not None
    assert sorted(g.steps) == [(2, 1), (4, 1), (4, 3)]  # captured once per (bucket, q); prefill and mixed ran eagerly
    assert {k: s.replays for k, s in g.steps.items()} == {(4, 1): 2, (4, 3): 1, (2, 1): 1}
    graph = g.steps[(4, 1)].graph
    assert isinstance(graph, EagerGraph) and graph.replays == 1  # the second decode step replayed the first's graph
    assert graphed.kv_caches[0].shape[2] == 41  # the scratch block beyond the scheduler's 40


def test_padding_rows_use_only_the_scratch_block(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    runner = _runner("cpu", torch.float32, graphs=True, monkeypatch=monkeypatch)
    assert runner._graphs is not None
    plan = _steps()[1]  # 3 decodes -> bucket 4
    inputs = runner._graphs.prepare(plan, plan_rows(plan.requests, BS))
    assert inputs is not None and inputs.key == (4, 1) and inputs.num_rows == 3
    assert inputs.num_blocks.tolist() == [2, 3, 4, 1]
    assert inputs.block_tables.shape == (4, 32 // BS + 1) and set(inputs.block_tables[3].tolist()) == {40}
    assert inputs.slots[3].item() == 40 * BS and inputs.query_pos[3].tolist() == [0]
    assert inputs.block_tables[0].tolist()[:3] == [0, 1, 1]  # the request's 2 blocks, padded with its last


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed, pairs = _run_both("cuda", torch.bfloat16, monkeypatch)
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert graphed._graphs is not None and sorted(graphed._graphs.steps) == [(2, 1), (4, 1), (4, 3)]


@pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")
@pytest.mark.parametrize(("speculative", "ahead"), [(False, False), (True, False), (True, True)])
def test_engine_greedy_tokens_same_with_the_cuda_path_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speculative: bool, ahead: bool
) -> None:
    """The whole engine, greedy, with the CUDA path's code on the host (paged decode, graphs' bookkeeping with the
    eager stand-in) gives the tokens of the gathered path; verification steps (n-gram drafts) replay graphs too;
    scheduled ahead, the plans reshaped by optimistic misses launch from the op library's one call
    (`plan_patch_step`: the runner's eager inputs from its outputs, or a graph's padding)."""
    from tandem.bench.common import drive
    from tandem.engine.llm import build_engine
    from tandem.params import SamplingParams
    from tests.tiny import save_tiny, tiny_model

    folder = save_tiny(tmp_path / "m", tiny_model("llama", seed=3))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False} if speculative else None
    prompts = [[1 + (i * 7 + j) % 5 for j in range(12)] for i in range(5)]  # repetitive: the n-gram drafts
    outs = []
    from_op: list[int] = []  # eager launches built from the op library's one call on a reshaped plan
    build = ModelRunner._inputs_from_op

    def counted(self: ModelRunner, rows: object, out: object) -> object:
        inputs = build(self, rows, out)  # type: ignore[arg-type]
        from_op.extend([1] if inputs is not None else [])
        return inputs

    monkeypatch.setattr(ModelRunner, "_inputs_from_op", counted)
    for attention, graphs in (("gather", "0"), ("paged", "1")):
        monkeypatch.setenv("TANDEM_DECODE_ATTENTION", attention)
        monkeypatch.setenv("TANDEM_CUDA_GRAPHS", graphs)
        engine = build_engine(str(folder), dtype="float32", progress=False, cpu_kernels=False, max_num_seqs=8,
                              num_kv_blocks=64, block_size=4, speculative_config=spec, async_scheduling=ahead)
        got: dict[str, list[int]] = {}
        drive(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), 5, "g",
              on_output=lambda o, got=got: got.__setitem__(o.request_id, list(o.outputs[0].token_ids)))
        outs.append(got)
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        stats = runner.graph_stats()
        misses = engine.get_stats().get("spec_optimistic_misses", 0)
        engine.shutdown()
    assert outs[0] == outs[1]
    assert stats["graph_steps"] > 0
    assert (misses > 0 and len(from_op) > 0) == ahead
