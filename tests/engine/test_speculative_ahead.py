"""Speculation scheduled ahead: the next plan is scheduled while the previous one verifies its drafts, with drafts
proposed past that outcome (every draft accepted plus the proposer's guess); rows whose assumption failed are
moved back or lose their drafts before the launch. Outputs must be exactly the target's (greedy: token for token
against the engine without drafts; sampled: the law of the tokens, chi-square), with n-gram, suffix and draft-model
proposers, guided requests, stop strings, tiny KV caches that preempt, aborts mid-flight; every KV block comes
back. The engines here run on the CPU, where a cheap proposer would by default draft after the outcome
(`draft_past_outcome`: its way on the host's cores); they draft past it, as beside an accelerator, except where a
test says otherwise."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.request import RequestOutput

from .test_engine import run_all
from .test_speculative import (
    GREEDY,
    _chi2,
    _chi2_threshold,
    _exact_pair_probs,
    _pair_counts,
    _story_prompts,
    cycle_method,  # noqa: F401 - fixture
    tiny_vocab_dir,  # noqa: F401 - fixture
)

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "draft_past_outcome": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "draft_past_outcome": True}
AFTER = dict(SUFFIX, draft_past_outcome=None)  # the CPU's own way: drafts after the outcome, before the launch


@pytest.fixture(params=["settled-first", "launched-first"])
def launch_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A test twice: with redrafts where they pay (at these few rows most steps settle the next plan's rows, and
    redraft, before its launch), and without (every step with drafts launches the next plan first, its rows
    settled after: `PlanEdits.outcome`); there it must have happened. tests/conftest.py checks each such launch's
    arrays against the rows once settled."""
    import tandem.engine.engine as engine_module
    from tandem.core.scheduler import Scheduler

    if request.param == "settled-first":
        yield request.param
        return
    monkeypatch.setattr(engine_module, "REDRAFT_YIELD", 0.0)  # no redraft pays
    calls = []
    edits = Scheduler.settled_edits

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return edits(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "settled_edits", counted)
    yield request.param
    assert calls, "no plan was launched before settle"


def _tokens(outs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [list(c.token_ids) for c in o.outputs] for rid, o in outs.items()}


def _texts(outs: dict[str, RequestOutput]) -> dict[str, list[tuple[str, str | None, object]]]:
    return {rid: [(c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for rid, o in outs.items()}


@pytest.mark.usefixtures("launch_order")
@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 7])
def test_greedy_tokens_are_the_targets(stories_engine_factory, config: dict, batch: int) -> None:  # type: ignore[no-untyped-def,type-arg]
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=config)
    assert ahead.async_scheduling and ahead.speculation.active
    prompts = _story_prompts(base, batch)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    stats = ahead.get_stats()
    assert stats["steps_scheduled_ahead"] == stats["num_steps"] > 0
    assert stats["steps_ahead_with_drafts"] > 0 and stats["spec_num_accepted"] > 0
    assert stats["spec_ahead_drafted"] > 0  # drafted past an outcome still in flight
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks


@pytest.mark.parametrize("batch", [1, 7])
def test_on_the_hosts_cores_drafts_wait_for_the_outcome(stories_engine_factory, batch: int) -> None:  # type: ignore[no-untyped-def]
    """A forward on the host's cores (this CPU engine) with a cheap proposer: by default nothing is proposed beside
    the forward (a proposal there slows it by its own time); each step's drafts come from the real outcome,
    between sampling and the launch, counted as the time the launch waited for drafting. The same tokens as the
    engine without drafts; no proposal made past an outcome."""
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=AFTER)
    assert ahead.runner.forward_uses_host_cores
    seen: list[bool] = []
    observe = ahead.speculation.observe_step

    def spy(num_tokens: int, seconds: float, draft_seconds: float, shared_cores: bool = False) -> None:
        seen.append(draft_seconds > 0.0)
        observe(num_tokens, seconds, draft_seconds, shared_cores)

    ahead.speculation.observe_step = spy  # type: ignore[method-assign]
    prompts = _story_prompts(base, batch)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    stats = ahead.get_stats()
    assert stats["steps_scheduled_ahead"] == stats["num_steps"] > 0
    assert stats["spec_num_accepted"] > 0 and stats["spec_redrafted"] > 0
    assert stats["spec_ahead_drafted"] == 0
    assert any(seen)  # adaptive K learns what drafting before the launch cost


@pytest.mark.usefixtures("launch_order")
def test_stop_strings_lengths_logprobs_and_penalties_match(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Greedy requests with stop strings, max_tokens, logprobs, a repetition penalty (its history must be the
    confirmed tokens, never a tentative draft or placeholder), min_tokens and n = 2; prompt logprobs, a logit bias,
    allowed token ids, a presence penalty with a stop string kept in the output, and stop token ids."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=30, stop=["park", "."]),
        SamplingParams(temperature=0.0, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=3 + 1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, n=2),
        SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={i: 3.0 for i in range(300, 320)}),
        SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=tuple(range(1, 400))),
        SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=0.7, stop=[" the"],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(426, 346)),  # (ids these stories emit)
    ]
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=NGRAM)
    prompts = _story_prompts(base, 20)
    got, want = {}, {}
    for engine, out in ((base, want), (ahead, got)):
        for i, (rid, p) in enumerate(prompts.items()):
            engine.add_request(rid, p, kinds[i % len(kinds)])
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o
    assert _tokens(got) == _tokens(want) and _texts(got) == _texts(want)
    for rid in prompts:
        assert str(got[rid].prompt_logprobs) == str(want[rid].prompt_logprobs)
        for a, b in zip(want[rid].outputs, got[rid].outputs, strict=True):
            if a.logprobs is not None:
                assert b.logprobs is not None and [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
    assert sum(o.prompt_logprobs is not None for o in got.values()) == 2
    assert {426, " the"} <= {c.stop_reason for o in got.values() for c in o.outputs}  # the stop rules did end some
    assert ahead.get_stats()["spec_num_accepted"] > 0


@pytest.mark.usefixtures("launch_order")
def test_intermediate_outputs_hold_no_tentative_token(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Every cumulative output while running is a prefix of the final one: no placeholder, no unverified draft."""
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    prompts = _story_prompts(ahead, 4)
    for rid, p in prompts.items():
        ahead.add_request(rid, p, GREEDY)
    seen: dict[str, list[list[int]]] = {rid: [] for rid in prompts}
    while ahead.has_unfinished_requests():
        for out in ahead.step():
            seen[out.request_id].append(list(out.outputs[0].token_ids))
    for rid, history in seen.items():
        final = history[-1]
        assert len(final) == GREEDY.max_tokens
        assert all(final[: len(h)] == h for h in history), rid


@pytest.mark.usefixtures("launch_order")
def test_preemption_and_prefix_cache_under_a_tiny_kv_cache(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    kv = {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 48}
    base = stories_engine_factory(async_scheduling=False, **kv)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=dict(NGRAM, num_speculative_tokens=5), **kv)
    prompts = _story_prompts(base, 8)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    assert ahead.block_manager.stats.hits > 0
    assert ahead.block_manager.num_free_blocks == 14  # every block came back, rolled-back drafts' included


@pytest.mark.usefixtures("launch_order")
def test_guided_requests_with_drafts(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Grammar masks of verified rows are filled from the real outcome during the next forward; drafts the grammar
    rejects are cut by those masks (lossless). Same tokens as the engine without drafts."""
    regex = StructuredOutputsParams(regex=r"(Lily|Tom) (ran|sat|went)( and (ran|sat|went))*\\.")
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"},
                                                                              "age": {"type": "integer"}},
                                           "required": ["name", "age"]})
    kinds = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=regex),
             SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=schema), GREEDY]
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    prompts = _story_prompts(base, 9)
    got, want = {}, {}
    for engine, out in ((base, want), (ahead, got)):
        for i, (rid, p) in enumerate(prompts.items()):
            engine.add_request(rid, p, kinds[i % len(kinds)])
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o
    assert _tokens(got) == _tokens(want) and _texts(got) == _texts(want)
    assert all(o.error is None for o in got.values())
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks


def _random_params(rng: random.Random) -> SamplingParams:
    """Greedy traffic of every kind: lengths, stops, min_tokens, logprobs, penalties, grammars (llguidance: a
    router's move to xgrammar would change a forced run's spelling), n = 2, prompt logprobs."""
    grammars = [StructuredOutputsParams(regex=r"(Lily|Tom) (ran|sat|went)( and (ran|sat|went))*\.", backend="llguidance"),
                StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"},
                                                                               "age": {"type": "integer"}},
                                              "required": ["name", "age"]}, backend="llguidance"),
                StructuredOutputsParams(choice=["Lily ran", "Lily sat", "Tom went to the park"], backend="llguidance")]
    kw: dict[str, Any] = {"temperature": 0.0, "max_tokens": rng.choice([1, 2, 3, 5, 8, 17, 40, 64])}
    options = [("ignore_eos", 0.4, lambda: True), ("stop", 0.3, lambda: [rng.choice([" the", ".", "Lily", "ed", ","])]),
               ("stop_token_ids", 0.2, lambda: [rng.randrange(3, 512)]), ("min_tokens", 0.2, lambda: rng.choice([1, 4, 9])),
               ("logprobs", 0.2, lambda: rng.choice([0, 2])), ("repetition_penalty", 0.2, lambda: 1.3),
               ("presence_penalty", 0.15, lambda: 0.5), ("structured_outputs", 0.3, lambda: rng.choice(grammars)),
               ("include_stop_str_in_output", 0.1, lambda: True), ("n", 0.15, lambda: 2),
               ("prompt_logprobs", 0.15, lambda: rng.choice([0, 1]))]
    for name, chance, value in options:
        if rng.random() < chance:
            kw[name] = value()
    kw["min_tokens"] = min(kw.get("min_tokens", 0), kw["max_tokens"])
    return SamplingParams(**kw)


def _run_traffic(engine: LLMEngine, requests: list[tuple[int, str, list[int], SamplingParams]],
                 aborts: dict[str, int]) -> dict[str, RequestOutput]:
    """Requests arrive at their steps, some are aborted at theirs; the finished outputs."""
    pending, done, step = sorted(requests, key=lambda r: r[0]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid in [rid for rid, at in aborts.items() if at == step]:
            engine.abort_request(rid)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    return done


def _outcome(o: RequestOutput) -> list[object]:
    """What a user reads of an output (logprobs: which tokens, not their last digits)."""
    prompt = None if o.prompt_logprobs is None else [None if d is None else sorted(d) for d in o.prompt_logprobs]
    return [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted(d) for d in c.logprobs]) for c in o.outputs] + [prompt, o.error]


def test_random_mixed_traffic_gives_the_synchronous_tokens(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Randomized: 20 batches of mixed greedy traffic arriving over the first steps, some requests aborted, through
    engines that keep their history (suffix trees, prefix caches) from batch to batch: scheduled ahead with suffix
    drafts past the outcome and after it, and with n-gram drafts under a KV cache small enough to preempt. Every
    finished request reads as it does from the synchronous engine without drafts; every KV block comes back. (A
    longer run of this kind, 4
    engines over 160 batches, found a preempted request's penalties lost for a token and a guided answer with
    `ignore_eos` going on past its grammar's EOS; their own tests carry the negative controls, this one passes
    before those fixes too.)"""
    base = stories_engine_factory(async_scheduling=False)
    engines = [stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX),
               stories_engine_factory(async_scheduling=True, speculative_config=dict(NGRAM, num_speculative_tokens=3),
                                      num_kv_blocks=20, block_size=8, max_num_batched_tokens=48),
               stories_engine_factory(async_scheduling=True, speculative_config=AFTER)]
    texts = [*(base.tokenizer.decode(p) for p in _story_prompts(base, 4).values()), "Lily", "Once upon a time"]
    for seed in range(20):
        rng = random.Random(seed)
        requests = [(rng.choice([0, 0, 0, 1, 2, 5, 9]), f"r{i}", base.tokenizer.encode(rng.choice(texts)),
                     _random_params(rng)) for i in range(rng.randint(4, 12))]
        want = _run_traffic(base, requests, {})
        for engine in engines:
            aborts = {r[1]: rng.randint(0, 12) for r in requests if rng.random() < 0.15}
            got = _run_traffic(engine, requests, aborts)
            for _, rid, _, params in requests:
                if rid not in aborts:
                    assert _outcome(got[rid]) == _outcome(want[rid]), (seed, rid, params)
            assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert all(e.get_stats()["spec_num_accepted"] > 0 for e in engines)
    assert engines[1].stats.num_preemptions > 0


def test_a_seeded_request_samples_the_same_tokens_with_drafts_or_without(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Seeded sampled requests (temperature, top-p, top-k, a repetition penalty, n = 2) emit exactly the tokens they
    emit without drafts: suffix drafts with adaptive K scheduled ahead, a fixed K synchronously, n-gram drafts
    scheduled ahead, and one request alone. Each row samples with its position's generator and a one-hot draft is
    accepted iff it is its row's sample, so neither how many drafts a step verified nor the batch moves a draw.
    (Before: two identical engines disagreed run to run, and a request alone differed from it in a batch.)"""
    rng = random.Random(3)
    texts = ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball. Tom had a",
             "The cat sat on the mat.", "Lily", "Once upon a time"]
    requests = {f"r{i}": (rng.choice(texts), SamplingParams(
        temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
        repetition_penalty=rng.choice([1.0, 1.2]), seed=rng.randrange(1000), max_tokens=40, n=rng.choice([1, 2])))
        for i in range(8)}

    def run(engine: LLMEngine, which: dict[str, tuple[str, SamplingParams]]) -> dict[str, list[list[int]]]:
        for rid, (prompt, params) in which.items():
            engine.add_request(rid, prompt, params)
        return {rid: [list(c.token_ids) for c in o.outputs] for rid, o in run_all(engine, {}).items()}

    want = run(stories_engine_factory(async_scheduling=False), requests)
    accepted = 0
    for args in ({"async_scheduling": True, "speculative_config": {"method": "suffix", "num_speculative_tokens": 4}},
                 {"async_scheduling": False, "speculative_config": SUFFIX},
                 {"async_scheduling": True, "speculative_config": dict(NGRAM, num_speculative_tokens=3)}):
        engine = stories_engine_factory(**args)
        assert run(engine, requests) == want, args
        accepted += engine.get_stats()["spec_num_accepted"]
    alone = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    assert run(alone, {"r7": requests["r7"]}) == {"r7": want["r7"]}
    assert accepted > 5  # (sampled at temperature 0.7-1, stories260K accepts few)


@pytest.mark.usefixtures("launch_order")
def test_aborts_mid_flight_return_every_block(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    prompts = _story_prompts(ahead, 6)
    for rid, p in prompts.items():
        ahead.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for step in range(12):
        ahead.step()
        if step in (3, 7):
            ahead.abort_request(f"p{step % 6}")
    while ahead.has_unfinished_requests():
        ahead.step()
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks


def test_draft_model_in_process(stories_engine_factory, stories_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """The target as its own draft: drafts for the next plan come from the look-ahead started at each launch."""
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config={
        "method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 3, "draft_dtype": "float32",
        "draft_in_process": True, "adaptive": False})
    prompts = _story_prompts(base, 3)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    stats = ahead.get_stats()
    assert stats["spec_acceptance_rate"] > 0.95 and stats["steps_ahead_with_drafts"] > 0


def test_llm_schedules_ahead_with_speculation(stories_dir: Path) -> None:
    from tandem import LLM

    llm = LLM(str(stories_dir), dtype="float32", progress=False, async_scheduling=True, speculative_config=SUFFIX)
    try:
        outs = llm.generate(["Once upon a time, there was a little girl named Lily. Once upon a time"],
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 24
        stats = llm.llm_engine.get_stats()
        assert stats["steps_scheduled_ahead"] > 0 and stats["spec_num_drafted"] > 0
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("launch_order")
def test_sampled_distribution_is_preserved_scheduled_ahead(tiny_vocab_dir: Path, cycle_method: str) -> None:  # noqa: F811
    """The joint law of two sampled tokens, the second from verifying a draft proposed past the first (kept when
    the first came out as guessed, else dropped and drafted again): the target's (chi-square, 3,000 samples)."""
    from tandem.engine.llm import build_engine

    n = 3000
    spec: LLMEngine = build_engine(str(tiny_vocab_dir), dtype="float32", progress=False, max_num_seqs=n,
                                   num_kv_blocks=2 * n, block_size=4, max_num_batched_tokens=4 * n, async_scheduling=True,
                                   speculative_config={"method": cycle_method, "num_speculative_tokens": 1,
                                                       "adaptive": False, "draft_past_outcome": True})
    probs = _exact_pair_probs(spec)
    # max_tokens 4: no request ends with the first verification, so the plan after it is launched before its rows
    # are settled (the plan after an ending request's step is settled first: its row is withdrawn)
    counts = _pair_counts(spec, n, seed=11, max_tokens=4)
    stats = spec.get_stats()
    assert stats["spec_num_drafted"] >= n // 2 and stats["spec_optimistic_misses"] > 0
    stat, dof = _chi2(counts, probs, n)
    assert stat < _chi2_threshold(dof), (stat, dof)


@pytest.mark.parametrize("alternate", [True, False], ids=["alternating-groups", "optimistic"])
def test_draft_model_overlap_ways_are_lossless(stories_engine_factory, stories_dir: Path, alternate: bool) -> None:  # type: ignore[no-untyped-def]
    """Alternating groups (half the requests verified while the drafter drafts the other half from its real
    outcome) and optimistic drafting past the outcome in flight: the same greedy tokens as no drafts."""
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config={
        "method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 3, "draft_dtype": "float32",
        "draft_in_process": True, "adaptive": False, "alternate_groups": alternate})
    prompts = _story_prompts(base, 6)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    stats = ahead.get_stats()
    assert stats["spec_num_accepted"] > 0
    assert (stats["spec_parked"] > 0) == alternate  # the groups really took turns
    assert ahead.block_manager.num_free_blocks == ahead.runner.num_blocks


@pytest.mark.usefixtures("launch_order")
def test_a_request_that_ends_while_its_drafted_row_is_in_flight(stories_engine_factory, cycle_method: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Requests stopped by a stop string while the next plan already holds their drafted row (a proposer that
    always drafts), beside always-masked guided rows (so the step has bitmasks): that row is verified and thrown
    away, in the rows its masks were filled for."""
    regex = StructuredOutputsParams(regex=r"[a-zA-Z ,.]{60,90}")  # free text: guided rows to the end
    guided = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex, logprobs=1)  # always masked
    stopped = SamplingParams(temperature=0.0, max_tokens=48, stop=[" play with", " happy"])
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config={
        "method": cycle_method, "num_speculative_tokens": 2, "adaptive": False, "draft_past_outcome": True})
    prompts = _story_prompts(base, 8)
    got, want = {}, {}
    for engine, out in ((base, want), (ahead, got)):
        for i, (rid, p) in enumerate(prompts.items()):
            engine.add_request(rid, p, guided if i % 4 == 0 else stopped)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o
    assert _tokens(got) == _tokens(want) and _texts(got) == _texts(want)
    assert sum(o.outputs[0].stop_reason is not None for o in got.values()) >= 4
    assert ahead.get_stats()["spec_num_drafted"] > 0


def test_misses_are_redrafted_while_a_redraft_pays(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """A cheap proposer's misses get drafts again before the launch at a few rows (outputs still the target's); a
    redraft that would cost a plan of many rows more than REDRAFT_YIELD tokens of a step is not made (it delays
    every row of the launch)."""
    from tandem.engine.engine import REDRAFT_SHARE, REDRAFT_YIELD

    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    prompts = _story_prompts(base, 2)
    want = run_all(base, prompts, GREEDY)
    got = run_all(ahead, prompts, GREEDY)
    assert _tokens(got) == _tokens(want)
    stats = ahead.get_stats()
    assert stats["spec_optimistic_misses"] > 0 and stats["spec_redrafted"] > 0
    ahead._forward_s.clear()
    ahead._forward_s.append(0.02)  # a 20 ms forward
    ahead._redraft_s = 40e-6  # one request's redraft: 40 us
    assert ahead._redraft_budget(1) == pytest.approx(REDRAFT_SHARE * 0.02)
    rows = REDRAFT_YIELD * 0.02 / 40e-6  # a redraft costs this many rows REDRAFT_YIELD tokens of a step
    assert ahead._redraft_budget(int(0.9 * rows)) > 0.0 and ahead._redraft_budget(int(1.1 * rows)) == 0.0


def test_a_redraft_reads_the_real_outcome(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """`settle` feeds only the next plan's rows before the launch; a request redrafted before it has learned its
    outcome first: nothing of it is tentative but its next row's placeholder (negative control: without
    `Scheduler.confirm` in `_redraft` the tail of the plan that just ran is still tentative there)."""
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    seen: list[int] = []
    redraft = ahead.speculation.redraft

    def spy(requests, allowed):  # type: ignore[no-untyped-def]
        seen.extend(req.num_tentative for req in requests)
        return redraft(requests, allowed)

    ahead.speculation.redraft = spy
    run_all(ahead, _story_prompts(ahead, 2), GREEDY)
    assert seen and set(seen) == {1}


@pytest.mark.usefixtures("launch_order")
def test_plans_read_ahead_equal_the_plans_at_each_launch(stories_engine_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Scheduling ahead with drafts (rows moved back, redrafted, withdrawn, fed between the read and the launch), the
    runner's arrays from its read ahead and the plan's edits (`Runner.prepare`, `StepPlan.edits`) equal what reading
    the rows at each launch gives (tests/conftest.py checks this at every launch of every test; here it must have
    happened, with rows reshaped; launched first, the rows are reshaped after the launch and checked then)."""
    from tandem.core.plan_arrays import InputsAhead

    take, checked = InputsAhead.take, []

    def spy(self, plan):  # type: ignore[no-untyped-def]
        outcome = plan.edits.outcome  # (launched first: the rows it reshapes come after its fed tokens)
        checked.append(len(plan.edits.reshaped) or int(outcome is not None and len(outcome) > 1 + 3 * outcome[0]))
        return take(self, plan)

    monkeypatch.setattr(InputsAhead, "take", spy)
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config=SUFFIX)
    prompts = _story_prompts(base, 6)
    assert _tokens(run_all(ahead, prompts, GREEDY)) == _tokens(run_all(base, prompts, GREEDY))
    assert len(checked) > 10 and any(checked) and not all(checked) and ahead.get_stats()["spec_optimistic_misses"] > 0
