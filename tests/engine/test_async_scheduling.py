"""Scheduling ahead (`async_scheduling`): the next plan is scheduled and launched before the previous step's outputs
are processed. Outputs must be exactly those of the synchronous engine (float32, stories260K): greedy and seeded
sampling, stop strings, max_tokens, n > 1, logprobs, preemption under a tiny KV cache, structured outputs, aborts
mid-flight; and every KV block comes back."""

from __future__ import annotations

import pytest

from tandem.engine.engine import LLMEngine
from tandem.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tandem.request import RequestOutput

from .test_engine import run_all

WORDS = ["Once upon a time", "The little dog", "Lily and Tom went to", "One day, a big bird", "The sun was"]


def _prompts(engine: LLMEngine, n: int) -> dict[str, list[int]]:
    tok = engine.tokenizer
    return {f"r{i}": tok.encode(WORDS[i % len(WORDS)] + " there" * (i % 4)) for i in range(n)}


def _params(i: int) -> SamplingParams:
    """A mix: greedy, seeded sampling with top-p/top-k, stop strings, n = 2, logprobs, varied max_tokens."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=100 + i, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["park", "."]),
        SamplingParams(temperature=1.0, seed=7 + i, n=2, max_tokens=12 + i % 5),
        SamplingParams(temperature=0.0, max_tokens=1 + i % 3, ignore_eos=True),
    ]
    return kinds[i % len(kinds)]


def _run(engine: LLMEngine, prompts: dict[str, list[int]], final_only: bool = False) -> dict[str, RequestOutput]:
    """Every request to its end; `final_only`: every other one reports only then (FINAL_ONLY, as LLM.generate's)."""
    for i, (rid, p) in enumerate(prompts.items()):
        kind = RequestOutputKind.FINAL_ONLY if final_only and i % 2 else RequestOutputKind.CUMULATIVE
        engine.add_request(rid, p, _params(i).clone(output_kind=kind))
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _same(a: dict[str, RequestOutput], b: dict[str, RequestOutput]) -> None:
    assert set(a) == set(b)
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
            if x.logprobs is not None:
                assert y.logprobs is not None and [list(d) for d in x.logprobs] == [list(d) for d in y.logprobs]


@pytest.mark.parametrize("kv", [{}, {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 32}])
def test_ahead_matches_synchronous(stories_engine_factory, kv) -> None:  # type: ignore[no-untyped-def]
    """Same outputs with and without scheduling ahead, with plenty of KV and with so little that requests wait
    or are preempted."""
    sync = stories_engine_factory(async_scheduling=False, **kv)
    ahead = stories_engine_factory(async_scheduling=True, **kv)
    assert not sync.async_scheduling and ahead.async_scheduling
    prompts = _prompts(sync, 15)
    _same(_run(sync, prompts), _run(ahead, prompts, final_only=True))
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks  # every block came back
    assert ahead.get_stats()["launch_gap_s"] >= 0


def test_ahead_structured_outputs_and_aborts(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory(async_scheduling=True)
    regex = StructuredOutputsParams(regex=r"(Lily|Tom) (ran|sat)( and (ran|sat))*\.")
    guided = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=regex)
    prompts = _prompts(engine, 6)
    for rid, p in prompts.items():
        engine.add_request(rid, p, guided if rid in ("r0", "r1", "r2") else SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.abort_request("r4")  # its next plan is already running: the result is dropped, its blocks freed
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for rid in ("r0", "r1", "r2"):
        import re

        o = done[rid].outputs[0]
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert re.fullmatch(r"(Lily|Tom) (ran|sat)( and (ran|sat))*\.", o.text), o.text
    assert "r4" not in done
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    sync = stories_engine_factory(async_scheduling=False)
    ref = run_all(sync, {rid: prompts[rid] for rid in ("r0", "r1", "r2")}, guided)
    for rid in ref:
        assert ref[rid].outputs[0].token_ids == done[rid].outputs[0].token_ids


def test_ahead_fill_pending_between_steps_and_an_abort_during_it(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Scheduling ahead, the next step's masks are still being filled (llguidance's threads) when `step` returns;
    aborting a guided request then leaves the others' outputs equal to the synchronous engine's."""
    engine = stories_engine_factory(async_scheduling=True)
    regex = StructuredOutputsParams(regex=r"(Lily|Tom) (ran|sat)( and (ran|sat))*\.", backend="llguidance")
    guided = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=regex)
    prompts = _prompts(engine, 3)
    for rid, p in prompts.items():
        engine.add_request(rid, p, guided)
    pending = 0
    for _ in range(6):
        engine.step()
        pending += engine._inflight is not None and engine._inflight.fill is not None
    assert pending >= 3
    engine.abort_request("r1")
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["r0", "r2"]
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    ref = run_all(stories_engine_factory(async_scheduling=False), {r: prompts[r] for r in ("r0", "r2")}, guided)
    for rid in ref:
        assert ref[rid].outputs[0].token_ids == done[rid].outputs[0].token_ids


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[RequestOutput, int, int]:
    """One request run to its end by itself: its output, the forwards launched and the steps collected."""
    launched = []
    launch = engine.runner.launch

    def counted(plan):  # type: ignore[no-untyped-def]
        launched.append(plan)
        return launch(plan)

    engine.runner.launch = counted  # type: ignore[method-assign]
    steps = engine.stats.num_steps
    out = run_all(engine, {"one": prompt}, params)["one"]
    del engine.runner.launch
    return out, len(launched), engine.stats.num_steps - steps


@pytest.mark.parametrize("spec", [None, {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["plain", "suffix"])
def test_a_request_its_tokens_end_is_not_launched_again(stories_engine_factory, spec) -> None:  # type: ignore[no-untyped-def]
    """Scheduling ahead, a request that its step's tokens end (its length, a stop token id, EOS; min_tokens holding
    them back) sits out the next plan: alone, every forward launched is collected, none computed to be thrown
    away; outputs are the synchronous engine's. A stop string shows only once detokenized: there one forward is
    still launched and thrown away."""
    sync = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=spec)
    prompt = sync.tokenizer.encode("Once upon a time")
    free = run_all(sync, {"free": prompt}, SamplingParams(temperature=0.0, max_tokens=60))["free"].outputs[0]
    ids, eos = list(free.token_ids), sync.tokenizer.eos_token_ids[0]
    stop_id = ids[4]  # its first use ends a request asked to stop there; min_tokens past it, a later use
    cases = [
        SamplingParams(temperature=0.0, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_id], min_tokens=ids.index(stop_id) + 1),
        SamplingParams(temperature=0.0, max_tokens=60),  # to EOS when the model emits one before 60 tokens
        SamplingParams(temperature=0.0, max_tokens=60, stop=[sync.tokenizer.decode(ids[6:8])]),
    ]
    for i, params in enumerate(cases):
        want = run_all(sync, {"one": prompt}, params)["one"].outputs[0]
        out, launched, collected = _alone(ahead, prompt, params)
        got = out.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        assert launched == collected + (1 if params.stop else 0), (i, launched, collected)
    assert eos in ids or len(ids) == 60
    assert ahead.get_stats()["num_ended_rows_withdrawn"] >= len(cases) - 1
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks
