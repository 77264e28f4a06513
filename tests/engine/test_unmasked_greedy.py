"""Unmasked greedy rows (engine/guidance.py): a greedy guided request in a free-text state skips its mask fill and
has its argmax checked afterwards. Outputs must be exactly those of masked sampling, on every path: the argmax kept,
a top candidate taken, the mask filled after all; in the step scheduled ahead, the synchronous step and beside
drafts being verified."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.bench.schemas import distinct_schemas
from tandem.bench.simulated import simulated_engine
from tandem.engine.engine import LLMEngine
from tandem.engine.guidance import StepMasks, masked_argmax_among
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.spec_decode.config import SpeculativeConfig
from tandem.tokenizer import Tokenizer

from ..structured.oracle import GrammarOracle
from .test_engine import run_all

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "note": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "note", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Tokenizer:
    d = tmp_path_factory.mktemp("gpt2-tokenizer")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(shared_data / "tokenizers" / "gpt2" / name, d / name)
    return Tokenizer.from_path(d)


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Every request at once; (request id -> (token ids, finish reason, error)), engine stats."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = run_all(engine, {})
    stats = engine.get_stats()
    engine.shutdown()
    return {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.error) for rid, o in done.items()}, stats


def _schema_requests(n: int, max_tokens: int = 40) -> dict[str, tuple[str, SamplingParams]]:
    return {f"r{i}": (f"Write a record {i}", SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                            structured_outputs=StructuredOutputsParams(json=s)))
            for i, s in enumerate(distinct_schemas(n, seed=11))}


@pytest.mark.parametrize("speculative", [False, True], ids=["scheduled-ahead", "with-suffix-drafts"])
def test_random_logits_give_the_masked_tokens(gpt2: Tokenizer, speculative: bool) -> None:
    """Noise logits (a simulated device) reject the argmax often, so every path is taken; the tokens, finish reasons
    and errors equal those of an engine that fills every mask. With suffix drafts (scheduled ahead too, drafted past
    the outcome in flight) the drafts are verified without masks too, and a request whose emitted tokens the grammar
    rejects is verified again with them."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False) if speculative else None
    # 80 tokens with drafts: noise logits loop, so drafts match. With 40 the drafts ahead (cut at the forward's
    # deadline, ~0 here) were 5-8 verified unmasked, and once on CI all rejected
    requests = _schema_requests(24, max_tokens=80 if speculative else 40)
    # every fill counts as costly (GPT-2's 50k vocabulary fills fast on a quick machine): the same paths everywhere
    engine = simulated_engine(gpt2, 0.0, 24, "llguidance", spec, rows_by_token=True, unmasked_min_fill_ms=0.0)
    engine.unmasked_checks.forced = False  # checked before each launch (after it: the tests below)
    engine.verify_checks.forced = False
    unmasked, stats = _run(engine, requests)
    masked, plain_stats = _run(simulated_engine(gpt2, 0.0, 24, "llguidance", spec, unmasked_greedy=False,
                                                rows_by_token=True), requests)
    assert unmasked == masked
    assert all(err is None for _, _, err in unmasked.values())
    assert plain_stats["guided_unmasked_rows"] == 0
    assert stats["guided_unmasked_rows"] > 50
    assert 0 < stats["guided_skips"] <= stats["guided_unmasked_rows"]  # told by the probe (or by the last mask)
    assert 0 < stats["guided_unmasked_rejected"] < stats["guided_unmasked_rows"]  # some argmaxes kept, some not
    assert stats["guided_candidate_hits"] > 0 and stats["guided_refills"] > 0  # both ways of settling a rejection
    # scheduled ahead, a refilled row is sampled during the next forward, which its request sits out; a rejected
    # unmasked verification is verified again before the next launch
    assert stats["num_late_rows"] + stats["guided_verify_rejected"] == stats["guided_refills"]
    if speculative:
        # (noise logits keep few unmasked verifications: ~4 of ~44 here, once none of 41 on CI; how many are kept
        # depends on chance and timing, the tokens equal the masked engine's either way)
        assert 0 < stats["guided_verify_rejected"] <= stats["guided_unmasked_verify"]
        assert plain_stats["guided_unmasked_verify"] == 0
    else:
        assert stats["guided_unmasked_verify"] == 0
    assert stats["grammar_rows_filled"] < plain_stats["grammar_rows_filled"]


def test_drafts_verified_unmasked_in_the_synchronous_step_give_the_masked_tokens(gpt2: Tokenizer) -> None:
    """The synchronous step (a CPU device's) with suffix drafts and noise logits: requests whose emitted tokens the
    grammar rejects are verified again with their masks before the step advances; tokens equal the always-masked
    engine's."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False)
    requests = _schema_requests(16)
    unmasked, stats = _run(simulated_engine(gpt2, 0.0, 16, "llguidance", spec, rows_by_token=True,
                                            unmasked_min_fill_ms=0.0, async_scheduling=False), requests)
    masked, _ = _run(simulated_engine(gpt2, 0.0, 16, "llguidance", spec, unmasked_greedy=False, rows_by_token=True,
                                      async_scheduling=False), requests)
    assert unmasked == masked
    assert stats["steps_scheduled_ahead"] == 0
    assert 0 < stats["guided_verify_rejected"] < stats["guided_unmasked_verify"]


@pytest.mark.parametrize("speculative", [False, True], ids=["scheduled-ahead", "with-suffix-drafts"])
def test_argmaxes_checked_after_the_next_launch_give_the_masked_tokens(gpt2: Tokenizer, speculative: bool) -> None:
    """Scheduling ahead, the next plan launched fed the unchecked argmaxes (`UnmaskedCheckPolicy` forced to check
    after the launch; tests/engine/test_unmasked.py: when it chooses to): every rejected one is retracted, its row
    of the plan in flight thrown away and its position fed again; the tokens, finish reasons and errors are those of
    an engine that fills every mask. With suffix drafts too: a retracted row is thrown away with the drafts it
    verifies."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False) if speculative else None
    requests = _schema_requests(24, max_tokens=80 if speculative else 40)  # 80: noise logits loop, drafts match
    engine = simulated_engine(gpt2, 0.0, 24, "llguidance", spec, rows_by_token=True, unmasked_min_fill_ms=0.0)
    engine.unmasked_checks.forced = True
    engine.verify_checks.forced = False  # (the drafts' checks after the launch: the test below)
    late, stats = _run(engine, requests)
    masked, _ = _run(simulated_engine(gpt2, 0.0, 24, "llguidance", spec, unmasked_greedy=False, rows_by_token=True),
                     requests)
    assert late == masked
    assert all(err is None for _, _, err in late.values())
    assert stats["guided_unmasked_rejected"] > 10
    if not speculative:
        assert stats["num_retracted_rows"] == stats["guided_unmasked_rejected"]  # each one's row in flight thrown away
        assert stats["num_late_rows"] == 0  # nothing withdrawn before a launch
    else:  # retracted after the launch (or settled with a rejected verification's request: not retracted again)
        assert 10 < stats["num_retracted_rows"] <= stats["guided_unmasked_rejected"]
        assert stats["spec_num_accepted"] > 50 and stats["guided_verify_rejected"] > 0


@pytest.mark.parametrize("argmaxes_late", [False, True], ids=["argmaxes-before", "argmaxes-after"])
def test_drafts_verified_unmasked_and_checked_after_the_next_launch_give_the_masked_tokens(
        gpt2: Tokenizer, argmaxes_late: bool) -> None:
    """Scheduling ahead with suffix drafts, the next plan launched (and the step settled) with the unchecked tokens
    of drafts verified without masks (`verify_checks` forced after the launch): a request whose tokens the grammar
    rejects is verified again with its masks, its tokens rewritten from the first that changed and its row in
    flight (drafts and all) thrown away. Noise logits reject often; the tokens, finish reasons and errors are those
    of an engine that fills every mask."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False)
    requests = _schema_requests(24, max_tokens=80)
    engine = simulated_engine(gpt2, 0.0, 24, "llguidance", spec, rows_by_token=True, unmasked_min_fill_ms=0.0)
    engine.verify_checks.forced = True
    engine.unmasked_checks.forced = argmaxes_late
    late, stats = _run(engine, requests)
    masked, _ = _run(simulated_engine(gpt2, 0.0, 24, "llguidance", spec, unmasked_greedy=False, rows_by_token=True),
                     requests)
    assert late == masked
    assert all(err is None for _, _, err in late.values())
    assert stats["spec_num_accepted"] > 50 and stats["guided_unmasked_verify"] > 50
    # every rejected verification rewrote its request and threw its row in flight away (or the request had none)
    assert 10 < stats["num_rewritten_rows"] <= stats["guided_verify_rejected"]
    assert (stats["num_retracted_rows"] > 10) == argmaxes_late


def test_unmasked_argmaxes_are_checked_after_the_launch_where_the_policy_says(gpt2: Tokenizer) -> None:
    """`LLMEngine._split_checks`: which unmasked argmaxes wait until after the next launch (with drafts or not)."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False)
    cur = SimpleNamespace(masks=SimpleNamespace(filled=StepMasks(None, None, unmasked=["a", "b", "c"])))
    for speculation, forced, split in ((spec, True, ([], ["a", "b", "c"])), (None, True, ([], ["a", "b", "c"])),
                                       (spec, False, (["a", "b", "c"], []))):
        engine = simulated_engine(gpt2, 0.0, 4, "llguidance", speculation, rows_by_token=True)
        engine.unmasked_checks.forced = forced
        assert engine._split_checks(cur, 5) == split  # type: ignore[arg-type]
        engine.shutdown()


# 6 ms, not 3: on the Xeon of this kind, in the full suite, a 3 ms forward's slack once fitted no row at all
@pytest.mark.parametrize("step_s", [0.006, 0.02], ids=["some-filled", "most-filled"])
def test_rows_filled_in_the_forwards_slack_give_the_masked_tokens(gpt2: Tokenizer, step_s: float) -> None:
    """Scheduled ahead beside a device whose forward takes `step_s`, rows that could go unmasked are filled while it
    runs (structured/slack_fill.py): with 6 ms some are and the others are checked after sampling, with 20 ms
    nearly all are; the tokens are the always masked engine's either way."""
    requests = _schema_requests(16, max_tokens=32)
    slack, stats = _run(simulated_engine(gpt2, step_s, 16, "llguidance", None, rows_by_token=True,
                                         unmasked_min_fill_ms=0.0), requests)
    masked, _ = _run(simulated_engine(gpt2, 0.0, 16, "llguidance", None, unmasked_greedy=False, rows_by_token=True),
                     requests)
    assert slack == masked
    assert stats["guided_slack_fills"] > 0
    assert stats["grammar_slack_fills"] == stats["guided_slack_fills"]


def test_a_real_model_gives_the_masked_tokens_and_valid_documents(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """stories260K (a CPU engine: the synchronous step, masks filled before the forward) keeps most of its own
    choices inside strings; outputs equal the always-masked engine's and validate against the schema."""
    so = StructuredOutputsParams(json=SCHEMA, backend="llguidance")
    requests = {f"s{i}": (p, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so))
                for i, p in enumerate(["Once upon a time", "Tom and Lily", "The cat", "One day"])}
    cheap = {"unmasked_min_fill_ms": 0.0}  # a 512-token vocabulary: every fill is cheap, skip them all the same
    unmasked, stats = _run(stories_engine_factory(max_model_len=512, structured_outputs_config=cheap), requests)
    masked, _ = _run(stories_engine_factory(max_model_len=512, structured_outputs_config={"unmasked_greedy": False}),
                     requests)
    assert unmasked == masked
    assert stats["guided_unmasked_rows"] > 0
    engine = stories_engine_factory(max_model_len=512, structured_outputs_config=cheap)
    oracle = GrammarOracle(engine.tokenizer.hf, engine.vocab_size, engine.eos_token_ids)
    for tokens, _, err in unmasked.values():
        assert err is None
        oracle.accepts(so, tokens, complete=False)  # fresh matchers of both backends take every token


def test_a_real_model_verifying_drafts_unmasked_gives_the_masked_tokens(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """stories260K in the synchronous step with suffix drafts: greedy guided requests verify their drafts without
    mask fills, checked after; tokens equal the always-masked engine's."""
    so = StructuredOutputsParams(json=SCHEMA, backend="llguidance")
    requests = {f"s{i}": (p, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so))
                for i, p in enumerate(["Once upon a time", "Tom and Lily", "The cat", "One day", "Once upon a time"])}
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    unmasked, stats = _run(stories_engine_factory(max_model_len=512, speculative_config=spec), requests)
    masked, plain = _run(stories_engine_factory(max_model_len=512, speculative_config=spec,
                                                structured_outputs_config={"unmasked_greedy": False}), requests)
    assert unmasked == masked
    assert stats["guided_unmasked_verify"] > 0 and stats["spec_num_accepted"] > 0
    assert plain["guided_unmasked_verify"] == 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "with-suffix-drafts"])
def test_rows_of_a_backend_whose_masks_are_narrower_than_its_matcher_stay_masked(gpt2: Tokenizer,
                                                                                 speculative: bool) -> None:
    """xgrammar's mask for a left-recursive grammar after "baa" allows "a" but not "aa", which its matcher accepts:
    a validated argmax would not be the masked one, so its rows are never sampled unmasked (llguidance's are), nor
    its drafts verified without masks."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False) if speculative else None
    so = StructuredOutputsParams(grammar='root ::= root "a" | "b"', backend="xgrammar")
    requests = {f"x{i}": (f"letters {i}", SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so))
                for i in range(4)}
    unmasked, stats = _run(simulated_engine(gpt2, 0.0, 4, "xgrammar", spec, rows_by_token=True,
                                            unmasked_min_fill_ms=0.0), requests)
    masked, _ = _run(simulated_engine(gpt2, 0.0, 4, "xgrammar", spec, unmasked_greedy=False, rows_by_token=True),
                     requests)
    assert unmasked == masked
    assert stats["guided_unmasked_rows"] == 0 and stats["guided_unmasked_verify"] == 0


def test_sampled_and_logprob_rows_are_always_masked(gpt2: Tokenizer) -> None:
    """Only greedy rows whose raw logits decide skip the mask: temperature, logprobs, penalties and logit bias keep
    it (their tokens or reported values depend on the masked distribution)."""
    so = StructuredOutputsParams(json=SCHEMA)
    variants = [SamplingParams(temperature=0.7, seed=1, max_tokens=30, structured_outputs=so),
                SamplingParams(temperature=0.0, logprobs=2, max_tokens=30, structured_outputs=so),
                SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=30, structured_outputs=so),
                SamplingParams(temperature=0.0, logit_bias={5: 1.0}, max_tokens=30, structured_outputs=so)]
    _, stats = _run(simulated_engine(gpt2, 0.0, 8, "llguidance", None),
                    {f"v{i}": ("hello", p) for i, p in enumerate(variants)})
    assert stats["guided_unmasked_rows"] == 0


def test_masked_argmax_among_candidates() -> None:
    allowed = {7, 9, 3}

    def first(order: list[int]) -> int | None:
        return next((i for i, t in enumerate(order) if t in allowed), None)

    assert masked_argmax_among([5.0, 4.0, 3.0, 1.0], [1, 9, 7, 2], first) == 9  # the highest allowed
    assert masked_argmax_among([4.0, 4.0, 1.0], [9, 7, 2], first) == 7  # a tie goes to the lower id
    assert masked_argmax_among([5.0, 2.0, 2.0], [1, 9, 2], first) is None  # ties the k-th value: may lose outside
    assert masked_argmax_among([5.0, 4.0], [1, 2], first) is None  # nothing allowed among the k
    assert masked_argmax_among([float("-inf")] * 3, [7, 9, 3], first) is None


def test_a_burst_of_new_grammars_compiles_during_the_forward_it_launches(gpt2: Tokenizer) -> None:
    """Beside an accelerator the grammars of arriving requests are registered at once (a refusal stays
    synchronous) but compile only once the engine has launched the next forward: none before the first step, all
    after; every document valid, the tokens those of an engine whose grammars compile from each arrival."""
    import json

    import jsonschema

    requests = _schema_requests(8, max_tokens=24)
    engine = simulated_engine(gpt2, 0.002, 8, "llguidance", None, rows_by_token=True)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    time.sleep(0.05)
    assert engine.guidance.manager.stats()["compiles"] == 0
    engine.step()  # the first forward launched: the compiles run beside it
    deadline = time.monotonic() + 10
    while engine.guidance.manager.stats()["compiles"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.guidance.manager.stats()["compiles"] == 8
    done = run_all(engine, {})
    engine.shutdown()
    for rid, (_, params) in requests.items():
        assert done[rid].error is None
        so = params.structured_outputs
        assert so is not None and so.json is not None
        if done[rid].outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(done[rid].outputs[0].text), so.json)
    at_once = simulated_engine(gpt2, 0.002, 8, "llguidance", None, rows_by_token=True)
    for rid, (prompt, params) in requests.items():  # each grammar compiling from its arrival, as on a CPU device
        at_once.add_request(rid, prompt, params)
        at_once.guidance.start_compiles()
    tokens = {rid: o.outputs[0].token_ids for rid, o in run_all(at_once, {}).items()}
    at_once.shutdown()
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == tokens
