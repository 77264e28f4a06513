"""Aborting every kind of request frees every block and every piece of per-request state, wherever the request
is: waiting, preempted, in a chunked prefill, decoding, verifying drafts (n-gram, suffix, a draft model with its
own KV cache), with a grammar still compiling or forcing drafts, with n > 1. A neighbour running beside it finishes
with exactly the output it has alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.request import RequestStatus

from .test_engine import run_all

NEIGHBOUR = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def leftovers(engine: LLMEngine) -> dict[str, Any]:
    """Every per-request structure of the engine and its parts that is not empty."""
    spec: Any = engine.speculation
    guidance: Any = engine.guidance
    state = {
        "groups": engine._groups, "seqs": engine._seqs, "scheduler": engine.scheduler._requests,
        "guidance pending": guidance._pending, "guidance ready": guidance._ready, "forced": guidance._forced,
        "failed": guidance._failed, "grammar requests": guidance.manager._requests,
        "spec guesses": getattr(spec, "_guess", {}), "lookahead": getattr(spec, "_ahead", {}),
    }
    proposer = getattr(spec, "proposer", None)
    for attr in ("_buffers", "_requests", "_mirrors"):  # n-gram, suffix, draft model
        state[f"proposer {attr}"] = getattr(proposer, attr, {})
    return {k: v for k, v in state.items() if v}


def _mentions(container: Any, target: str) -> bool:
    """Whether a per-request dict / set holds `target` or one of its sequences (`target#i`)."""
    return any(k == target or str(k).startswith(target + "#") for k in container)


def step_until(engine: LLMEngine, done: Callable[[], bool], limit: int = 500) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError("the state to abort in was never reached")


def _decoding(engine: LLMEngine, rid: str, tokens: int = 3) -> Callable[[], bool]:
    def check() -> bool:
        seq = engine._seqs.get(rid)
        return seq is not None and seq.req.num_output_tokens >= tokens
    return check


KINDS = ["waiting", "preempted", "chunked-prefill", "decode", "n4", "ngram", "suffix", "draft-model",
         "grammar-compiling", "grammar-forced-drafts"]


@pytest.mark.parametrize("kind", KINDS)
def test_abort_frees_everything_and_leaves_the_neighbour_alone(stories_engine_factory, stories_dir, kind: str,  # type: ignore[no-untyped-def]
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    kw: dict[str, Any] = {"max_model_len": 512}
    if kind == "waiting":
        kw["max_num_seqs"] = 1
    if kind == "preempted":
        kw.update(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
    if kind == "chunked-prefill":
        kw["max_num_batched_tokens"] = 32
    if kind in ("ngram", "suffix"):
        kw["speculative_config"] = {"method": kind, "num_speculative_tokens": 4, "adaptive": False}
    if kind == "draft-model":
        kw["speculative_config"] = {"method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 3,
                                    "draft_dtype": "float32", "draft_in_process": True, "adaptive": False}
    release = threading.Event()
    if kind == "grammar-compiling":  # a compile that cannot finish before the abort
        from tandem.structured.llguidance_backend import LLGuidanceBackend

        real = LLGuidanceBackend.compile

        def blocked(self, spec):  # type: ignore[no-untyped-def]
            if "blocked" in spec.text:
                release.wait(120)
            return real(self, spec)

        monkeypatch.setattr(LLGuidanceBackend, "compile", blocked)
    engine = stories_engine_factory(**kw)
    prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"
    alone = run_all(stories_engine_factory(max_model_len=512), {"n": prompt}, NEIGHBOUR)["n"].outputs[0].token_ids
    try:
        target = _add_target(engine, kind, prompt)
        step_until(engine, _reached(engine, kind, target))
        engine.abort_request(target)
        assert not {k: v for k, v in leftovers(engine).items() if _mentions(v, target)}, leftovers(engine)
    finally:
        release.set()
    done = run_all(engine, {})
    assert target not in done and done["n"].outputs[0].token_ids == alone
    assert not engine.has_unfinished_requests() and not leftovers(engine)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    if kind == "draft-model":  # its own cache too: releases go out with the next message to the draft
        proposer: Any = engine.speculation.proposer  # type: ignore[attr-defined]
        proposer.propose([])
        core = proposer.backend.core
        assert core.num_requests == 0 and core.blocks.num_free_blocks == core.info.num_blocks


def _add_target(engine: LLMEngine, kind: str, prompt: str) -> str:
    """Add the neighbour and the request to abort (in the order the kind needs); returns the target's id."""
    target = "t"
    if kind == "preempted":  # 8 requests on 12 blocks of 8: some are preempted; the last admitted goes first
        for i in range(7):
            engine.add_request(f"p{i}", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        engine.add_request("n", prompt, NEIGHBOUR)
        return "p6"
    if kind == "waiting":
        engine.add_request("n", prompt, NEIGHBOUR)  # max_num_seqs 1: the target waits behind it
        engine.add_request(target, prompt, LONG)
        return target
    engine.add_request("n", prompt, NEIGHBOUR)
    if kind == "chunked-prefill":
        engine.add_request(target, [1] + [5, 6, 7, 8] * 100, LONG)  # 401 tokens in chunks of <= 32
    elif kind == "n4":
        engine.add_request(target, prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=200, ignore_eos=True))
    elif kind == "grammar-compiling":
        so = StructuredOutputsParams(json={"type": "object", "properties": {"blocked": {"type": "string"}}}, backend="llguidance")
        engine.add_request(target, prompt, SamplingParams(max_tokens=50, structured_outputs=so))
    elif kind == "grammar-forced-drafts":
        word = "abcdefghij" * 8  # one choice: every token after the first is forced, proposed as drafts
        engine.add_request(target, prompt, SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(choice=[word])))
    else:
        engine.add_request(target, prompt, LONG)
    return target


def _reached(engine: LLMEngine, kind: str, target: str) -> Callable[[], bool]:
    """The state the target must be in when it is aborted."""
    def seq() -> Any:
        return engine._seqs[target if kind != "n4" else f"{target}#0"].req

    if kind == "waiting":
        return lambda: _decoding(engine, "n")() and seq().status is RequestStatus.WAITING
    if kind == "preempted":
        return lambda: seq().status is RequestStatus.PREEMPTED and seq().num_output_tokens > 0
    if kind == "chunked-prefill":
        return lambda: 0 < seq().num_computed_tokens < seq().num_prompt_tokens
    if kind == "grammar-compiling":
        return lambda: _decoding(engine, "n")() and engine.guidance.has_pending
    if kind in ("ngram", "suffix", "draft-model"):  # drafts verified; the proposer holds the request's state
        return lambda: engine.get_stats()["spec_num_accepted"] > 0 and _decoding(engine, target)()
    if kind == "grammar-forced-drafts":
        return lambda: engine.get_stats()["guided_forced_tokens"] > 0 and _decoding(engine, target)()
    return lambda: all(engine._seqs[s.request_id].req.num_output_tokens >= 3 for s in engine._groups[target].seqs)


def test_the_leftover_check_sees_a_leak(stories_engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Negative control: with the proposer's release broken, the n-gram abort above leaves state behind."""
    engine = stories_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    monkeypatch.setattr(engine.speculation.proposer, "release", lambda request_id: None)  # type: ignore[attr-defined]
    target = _add_target(engine, "ngram", "Once upon a time, there was a little girl. Once upon a time")
    step_until(engine, _reached(engine, "ngram", target))
    engine.abort_request(target)
    assert "proposer _buffers" in leftovers(engine)
