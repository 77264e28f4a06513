"""End-to-end engine behaviour on the real trained stories260K model (fast) and the demo model (marked demo)."""

from __future__ import annotations

import gc

import pytest

from tandem.engine.engine import YOUNG_GC_THRESHOLD, LLMEngine, freeze_startup_heap
from tandem.params import ParamError, RequestOutputKind, SamplingParams
from tandem.request import RequestOutput

from ..conftest import STORIES_GREEDY

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def run_all(
    engine: LLMEngine, prompts: dict[str, list[int] | str], params: SamplingParams = GREEDY
) -> dict[str, RequestOutput]:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_stories_golden_greedy(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The known greedy continuation of stories260K from BOS (checked by an independent numpy forward)."""
    engine = stories_engine_factory()
    out = run_all(engine, {"a": [1]}, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))["a"]
    assert out.outputs[0].text.startswith(STORIES_GREEDY)


def _prompts(engine: LLMEngine, n: int) -> dict[str, list[int]]:
    words = [
        "Once upon a time",
        "The little dog",
        "Lily and Tom went to",
        "One day, a big bird",
        "The sun was",
    ]
    tok = engine.tokenizer
    return {f"r{i}": tok.encode(words[i % len(words)] + " " * (i % 3) + "there" * (i % 4)) for i in range(n)}


def test_batch_invariance(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """A request's greedy output is the same alone and inside a batch of 16 mixed-length requests."""
    engine = stories_engine_factory(max_num_batched_tokens=64)
    prompts = _prompts(engine, 16)
    batched = run_all(engine, prompts)
    for rid in ("r0", "r7", "r15"):
        alone = run_all(engine, {rid + "-solo": prompts[rid]})[rid + "-solo"]
        assert alone.outputs[0].token_ids == batched[rid].outputs[0].token_ids


def test_final_only_requests_report_once_with_the_same_outputs(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """FINAL_ONLY (as LLM.generate sends): one output per request, at its end, equal to the cumulative one's final
    output (text detokenized at the end; with a stop string, per token), beside cumulative requests."""
    engine = stories_engine_factory()
    prompts = _prompts(engine, 6)
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "final": RequestOutputKind.FINAL_ONLY}
    params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=25, n=2, logprobs=2)]
    for rid, prompt in prompts.items():
        for name, kind in kinds.items():
            engine.add_request(f"{rid}-{name}", prompt, params[int(rid[1:]) % 3].clone(output_kind=kind))
    reports: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    for rid in prompts:
        final, cumulative = reports[f"{rid}-final"], reports[f"{rid}-cumulative"]
        assert len(final) == 1 and final[0].finished and len(cumulative) > 1
        for a, b in zip(final[0].outputs, cumulative[-1].outputs, strict=True):
            assert (a.text, a.token_ids, a.finish_reason, a.logprobs) == (b.text, b.token_ids, b.finish_reason, b.logprobs)
        assert final[0].metrics is not None and final[0].metrics.first_token_time is not None
    for bad in (1, "final"):  # vLLM's DELTA (1) is not offered: the server makes its own deltas
        with pytest.raises(ParamError, match="output_kind must be"):
            SamplingParams(output_kind=bad)  # type: ignore[arg-type]


def test_preemption_keeps_outputs(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """With a KV budget far too small for the batch, every request still finishes with the output it has alone."""
    small = stories_engine_factory(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
    prompts = _prompts(small, 8)
    got = run_all(small, prompts)
    assert small.stats.num_preemptions > 0
    assert small.block_manager.num_free_blocks == 12
    ref = stories_engine_factory()
    for rid, p in prompts.items():
        alone = run_all(ref, {rid: p})[rid]
        assert got[rid].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "scheduled-ahead"])
def test_preempted_requests_keep_their_penalties(stories_engine_factory, ahead: bool) -> None:  # type: ignore[no-untyped-def]
    """A preempted request's first token after its prefill is recomputed reads its whole output so far: repetition,
    frequency and presence penalties and min_tokens see the same history as without the preemption (its sampling
    row read the output up to the chunk's first position: none of it; 3 and 2 of these 8 outputs changed)."""
    penalties = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.8), dict(presence_penalty=1.0),
                 dict(repetition_penalty=1.5, min_tokens=30)]
    small = stories_engine_factory(num_kv_blocks=20, block_size=8, max_num_batched_tokens=32, async_scheduling=ahead)
    prompts = _prompts(small, 8)
    params = {rid: SamplingParams(temperature=0.0, max_tokens=48, **penalties[i % len(penalties)])
              for i, rid in enumerate(prompts)}
    for rid, p in prompts.items():
        small.add_request(rid, p, params[rid])
    got = run_all(small, {})
    assert small.stats.num_preemptions > 0
    ref = stories_engine_factory(async_scheduling=ahead)
    for rid, p in prompts.items():
        alone = run_all(ref, {rid: p}, params[rid])[rid]
        assert got[rid].outputs[0].token_ids == alone.outputs[0].token_ids, rid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_hit_gives_identical_output(stories_engine_factory, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Also in bf16: a prefix served from the cache and one computed in the same step go through the same math."""
    engine = stories_engine_factory(block_size=4, dtype=dtype)
    prefix = engine.tokenizer.encode(
        "Once upon a time, there was a little girl named Lily. She loved to play"
    )
    first = run_all(engine, {"a": prefix + [5]})["a"]
    hits_before = engine.block_manager.stats.hits
    second = run_all(engine, {"b": prefix + [5]})["b"]
    assert engine.block_manager.stats.hits - hits_before >= (len(prefix) // 4) * 4 - 4
    assert second.metrics is not None and second.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    nocache = stories_engine_factory(block_size=4, enable_prefix_caching=False, dtype=dtype)
    third = run_all(nocache, {"c": prefix + [5]})["c"]
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_independent_of_batch(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory()
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    alone = run_all(engine, {"s": [1]}, p)["s"].outputs[0].token_ids
    for rid in ("x", "y", "z"):
        engine.add_request(rid, [1], SamplingParams(temperature=1.0, max_tokens=30))
    mixed = run_all(engine, {"s2": [1]}, p)["s2"].outputs[0].token_ids
    assert alone == mixed


def test_n_best_and_logprobs(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory()
    p = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    out = run_all(engine, {"a": engine.tokenizer.encode("Once upon a time")}, p)["a"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different samples
    for o in out.outputs:
        assert len(o.token_ids) == 12 and o.logprobs is not None and len(o.logprobs) == 12
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and lp[tok].logprob <= 0.0
            assert len(lp) <= 3
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_stop_strings_and_max_tokens(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory()
    out = run_all(engine, {"a": [1]}, SamplingParams(temperature=0.0, max_tokens=60, stop=["Lily"]))[
        "a"
    ].outputs[0]
    assert out.text == "Once upon a time, there was a little girl named " and out.finish_reason == "stop"
    assert out.stop_reason == "Lily"
    out = run_all(engine, {"b": [1]}, SamplingParams(temperature=0.0, max_tokens=5))["b"].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_bad_requests_fail_alone(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory(max_model_len=64)
    engine.add_request("good", [1], GREEDY)
    with pytest.raises(ParamError, match="max_model_len"):
        engine.add_request("long", [1] * 100, GREEDY)
    with pytest.raises(ParamError, match="vocabulary"):
        engine.add_request("oov", [1, 99999], GREEDY)
    with pytest.raises(ParamError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ParamError, match="already in use"):
        engine.add_request("good", [1], GREEDY)
    with pytest.raises(ParamError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ParamError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ParamError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ParamError, match="stop must be"):
        SamplingParams(stop=123)  # type: ignore[arg-type]
    done = run_all(engine, {})
    assert done["good"].outputs[0].text.startswith("Once upon a time")


def test_abort_frees_blocks(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory(num_kv_blocks=32)
    engine.add_request("a", [1], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_free_blocks < 32
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 32


@pytest.mark.demo
@pytest.mark.slow
def test_demo_model_greedy_matches_transformers(demo_model_dir) -> None:  # type: ignore[no-untyped-def]
    """fp32 greedy token-for-token equality with transformers on SmolLM2-135M-Instruct, several prompts."""
    import torch
    import transformers

    from tandem.engine.llm import build_engine

    engine = build_engine(str(demo_model_dir), dtype="float32", progress=False, max_model_len=512)
    ref = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32).eval()
    tok = engine.tokenizer
    prompts = [
        "The capital of France is",
        "def add(a, b):",
        "Q: What is 12 * 7?\nA:",
        tok.hf.apply_chat_template(
            [{"role": "user", "content": "Name three colors."}], tokenize=False, add_generation_prompt=True
        ),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = run_all(engine, {str(i): p for i, p in enumerate(prompts)}, params)
    for i, p in enumerate(prompts):
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            exp = ref.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        assert len(exp) >= 8
        assert got[str(i)].outputs[0].token_ids[: len(exp)] == exp, p


def test_stats_count_what_ran(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """get_stats(): token counters equal what the outputs and prompts hold; each timed phase ran."""
    from tandem.params import StructuredOutputsParams

    engine = stories_engine_factory(enable_prefix_caching=False)
    prompts = {"a": "Once upon a time", "b": "The little dog ran", "c": "Tom"}
    for rid, p in prompts.items():
        so = StructuredOutputsParams(choice=["yes", "no"]) if rid == "c" else None
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=7, structured_outputs=so))
    done = run_all(engine, {})
    stats = engine.get_stats()
    assert stats["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in done.values())
    assert stats["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in done.values())
    assert stats["forward_s"] > 0 and stats["sample_s"] > 0 and stats["grammar_mask_fill_s"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def test_a_kept_engine_collects_the_young_generation_less_often() -> None:
    """`freeze_startup_heap` (a process that keeps its engine) raises the young generation's threshold to
    YOUNG_GC_THRESHOLD; a higher one the process set itself, or automatic collection turned off (0), is kept."""
    saved = gc.get_threshold()
    try:
        for before, after in (((700, 10, 10), (YOUNG_GC_THRESHOLD, 10, 10)), ((50_000, 5, 7), (50_000, 5, 7)),
                              ((0, 10, 10), (0, 10, 10))):
            gc.set_threshold(*before)
            freeze_startup_heap()
            assert gc.get_threshold() == after
    finally:
        gc.set_threshold(*saved)
