"""Reasoning models in the engine (tandem/engine/thinking.py): the grammar starts only after the thinking, the
budget forces the end marker, and the split of text and tokens is the same on every path (synchronous, scheduled
ahead, with drafts, n > 1, final-only outputs). A random-weight Llama over GPT-2's real vocabulary with the generic
parser: "</think>" is three tokens there, so the marker is matched (and forced) as a token sequence."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tandem import SamplingParams, StructuredOutputsParams
from tandem.engine.engine import LLMEngine
from tandem.params import ParamError
from tandem.request import CompletionOutput, RequestOutput
from tandem.spec_decode.registry import register_proposer

from .scripted import ScriptedProposer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
THINK = "Question: what is it?\n<think>\n"  # the prompt opens the block
NO_THINK = "Question: what is it?\n<think>\n\n</think>\n\n"  # ... or closes an empty one
BUDGET = 6
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "ahead": {"async_scheduling": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}},
    "suffix-ahead": {"async_scheduling": True, "speculative_config": {"method": "suffix", "num_speculative_tokens": 4,
                                                                    "draft_past_outcome": True}},
    # the CPU's own way with a cheap proposer: drafted after the outcome, before the launch
    "suffix-after": {"async_scheduling": True, "speculative_config": {"method": "suffix", "num_speculative_tokens": 4}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    import torch
    import transformers

    from tandem.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("reasoning-gpt2")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(shared_data / "tokenizers" / "gpt2" / name, d / name)
    tok = Tokenizer.from_path(d).hf
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


def engine(model_dir: Path, **kw: Any) -> LLMEngine:
    from tandem.engine.llm import build_engine

    return build_engine(str(model_dir), dtype="float32", progress=False, max_model_len=1024,
                        reasoning_parser=kw.pop("reasoning_parser", "generic"), **kw)


def run(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def guided(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def check_answer(c: CompletionOutput) -> None:
    assert c.finish_reason == "stop", c
    assert c.content is not None
    jsonschema.validate(json.loads(c.content), SCHEMA)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, RequestOutput]:
    eng = engine(model_dir)
    try:
        return run(eng, {"guided": (THINK, guided(thinking_token_budget=BUDGET)),
                         "free": (THINK, SamplingParams(max_tokens=BUDGET, temperature=0)),
                         "long": (THINK, SamplingParams(max_tokens=20, temperature=0))})
    finally:
        eng.shutdown()


def test_the_grammar_starts_after_the_forced_end(reference: dict[str, RequestOutput], model_dir: Path) -> None:
    eng = engine(model_dir)
    end_ids = list(eng.thinking.reasoner.markers.end_ids)
    eng.shutdown()
    c, free = reference["guided"].outputs[0], reference["free"].outputs[0]
    assert len(end_ids) == 3
    # the thinking is the model's own greedy choice, untouched by the grammar, then the forced marker
    assert c.token_ids[:BUDGET] == free.token_ids
    assert c.token_ids[BUDGET : BUDGET + 3] == end_ids
    assert c.num_reasoning_tokens == BUDGET + 3
    assert c.reasoning == free.text and c.text == free.text + "</think>" + c.content
    check_answer(c)


def test_a_thinking_that_never_ends_is_all_reasoning(reference: dict[str, RequestOutput]) -> None:
    c = reference["long"].outputs[0]
    assert c.finish_reason == "length" and c.content is None
    assert c.reasoning == c.text and c.num_reasoning_tokens == 20


@pytest.mark.parametrize("mode", [m for m in MODES if m != "sync"])
def test_every_path_gives_the_same_tokens_and_split(mode: str, reference: dict[str, RequestOutput],
                                                   model_dir: Path) -> None:
    eng = engine(model_dir, **MODES[mode])
    try:
        outs = run(eng, {"guided": (THINK, guided(thinking_token_budget=BUDGET)),
                         "long": (THINK, SamplingParams(max_tokens=20, temperature=0))})
    finally:
        eng.shutdown()
    for rid, out in outs.items():
        want, got = reference[rid].outputs[0], out.outputs[0]
        assert (got.token_ids, got.reasoning, got.content, got.num_reasoning_tokens) == \
               (want.token_ids, want.reasoning, want.content, want.num_reasoning_tokens), (mode, rid)


def _logprob_rows(c: CompletionOutput) -> list[tuple[int, float, list[int]]]:
    """(token, its logprob, the entry's ids) per emitted token; checks one entry per token, each with its token,
    summing to the cumulative logprob."""
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert all(t in entry for t, entry in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), abs=1e-3)
    return [(t, round(e[t].logprob, 3), sorted(e)) for t, e in zip(c.token_ids, c.logprobs)]


def _draft_the_thinking_on(reference: dict[str, RequestOutput]) -> None:
    """Register "thinking-on": a proposer drafting the thinking the model writes without a budget (the reference's
    20 greedy tokens), wherever the output so far is a prefix of it: verified, those drafts are all accepted."""
    free = list(reference["long"].outputs[0].token_ids)
    prompt_len = len(reference["long"].prompt_token_ids)

    def thinking_on(token_ids: Sequence[int], k: int) -> list[int]:
        out = list(token_ids[prompt_len:])
        return free[len(out) : len(out) + k] if free[: len(out)] == out else []

    register_proposer("thinking-on", lambda **_: ScriptedProposer("thinking-on", thinking_on))


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "scheduled-ahead"])
def test_logprobs_follow_the_emitted_tokens_through_a_forced_end(ahead: bool, model_dir: Path,
                                                                   reference: dict[str, RequestOutput]) -> None:
    """A spent budget's forced marker tokens have entries of their own (their logprob under the model, as a
    sampled token's), and drafts verified past the budget (the thinking the model would go on with, drafted and
    accepted) leave none behind: one entry per emitted token, those of the synchronous step without drafts."""
    _draft_the_thinking_on(reference)
    requests = {"free": (THINK, SamplingParams(max_tokens=24, temperature=0, logprobs=2, thinking_token_budget=4)),
                "guided": (THINK, guided(logprobs=1, thinking_token_budget=BUDGET))}
    want = run(sync := engine(model_dir), requests)
    sync.shutdown()
    eng = engine(model_dir, async_scheduling=ahead,
                 speculative_config={"method": "thinking-on", "num_speculative_tokens": 8, "adaptive": False})
    try:
        outs = run(eng, requests)
        assert eng.get_stats()["spec_num_accepted"] > 6  # drafts up to the budget, and past it
    finally:
        eng.shutdown()
    for rid in requests:
        assert _logprob_rows(outs[rid].outputs[0]) == _logprob_rows(want[rid].outputs[0]), rid


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "scheduled-ahead"])
def test_a_stop_string_in_the_thinking_counts_the_tokens_kept(ahead: bool, model_dir: Path,
                                                              reference: dict[str, RequestOutput]) -> None:
    """A stop string inside the thinking, in a step that verified a run of drafts past it: the tokens after it
    are dropped, and not counted as reasoning tokens either (they were: 10 for an output of 5)."""
    _draft_the_thinking_on(reference)
    free = reference["long"].outputs[0]
    eng = engine(model_dir, async_scheduling=ahead,
                 speculative_config={"method": "thinking-on", "num_speculative_tokens": 8, "adaptive": False})
    pieces = [eng.tokenizer.decode([t]) for t in free.token_ids]
    at = next(i for i in range(4, len(pieces)) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    params = SamplingParams(max_tokens=20, temperature=0, stop=[pieces[at]])
    try:
        got = run(eng, {"s": (THINK, params)})["s"].outputs[0]
        assert eng.get_stats()["spec_num_accepted"] > at
    finally:
        eng.shutdown()
    want = run(sync := engine(model_dir), {"s": (THINK, params)})["s"].outputs[0]
    sync.shutdown()
    assert want.finish_reason == "stop" and want.content is None and want.num_reasoning_tokens == len(want.token_ids)
    assert (got.token_ids, got.text, got.reasoning, got.num_reasoning_tokens) == \
           (want.token_ids, want.text, want.reasoning, want.num_reasoning_tokens)


def test_a_parser_set_between_runs_forces_the_end_and_guides_the_answer(model_dir: Path,
                                                                        reference: dict[str, RequestOutput]) -> None:
    """`set_reasoning` (the demo's way in): an engine built without a parser thinks, is forced out of its thinking
    and answers under the grammar as one built with it; set back to None, nothing of the same prompt is reasoning."""
    eng = engine(model_dir, reasoning_parser=None)
    try:
        eng.set_reasoning("generic")
        c = run(eng, {"g": (THINK, guided(thinking_token_budget=BUDGET))})["g"].outputs[0]
        assert (c.token_ids, c.num_reasoning_tokens) == (reference["guided"].outputs[0].token_ids,
                                                         reference["guided"].outputs[0].num_reasoning_tokens)
        check_answer(c)
        eng.set_reasoning(None)
        plain = run(eng, {"p": (THINK, SamplingParams(max_tokens=12, temperature=0, logprobs=0))})["p"].outputs[0]
        assert plain.reasoning is None and plain.num_reasoning_tokens == 0 and len(plain.logprobs or []) == 12
    finally:
        eng.shutdown()


def test_a_closed_block_answers_under_the_grammar_from_the_first_token(model_dir: Path) -> None:
    eng = engine(model_dir)
    try:
        c = run(eng, {"r": (NO_THINK, guided())})["r"].outputs[0]
    finally:
        eng.shutdown()
    assert c.reasoning is None and c.num_reasoning_tokens == 0 and c.content == c.text
    check_answer(c)


@pytest.mark.parametrize("mode", ["sync", "ahead", "suffix-ahead", "suffix-after"])
def test_a_grammar_that_holds_the_thinking_too_starts_at_the_first_token(mode: str, model_dir: Path) -> None:
    """`enable_in_reasoning`: the grammar is not deferred to the end of the thinking; it holds the thinking (a few
    lowercase letters), the end marker and the answer, and the split still follows the marker."""
    grammar = f'start: THOUGHT "</think>" %json {json.dumps(SCHEMA)}\nTHOUGHT: /[a-z]{{2,6}}/\n'
    so = StructuredOutputsParams(grammar=grammar, backend="llguidance", enable_in_reasoning=True)
    eng = engine(model_dir, **MODES[mode])
    try:
        c = run(eng, {"r": (THINK, SamplingParams(max_tokens=48, temperature=0, structured_outputs=so))})["r"].outputs[0]
    finally:
        eng.shutdown()
    assert c.reasoning is not None and 2 <= len(c.reasoning) <= 6 and c.reasoning.isalpha() and c.reasoning.islower()
    assert c.text == c.reasoning + "</think>" + (c.content or "")
    check_answer(c)


def test_the_engine_wide_switch_holds_every_grammar_over_the_thinking(model_dir: Path) -> None:
    """vLLM's `structured_outputs_config={"enable_in_reasoning": True}`: every guided request of the engine is as if
    it asked for it itself (token for token the same, the grammar over the thinking), several at once, each its own
    grammar; a guided request with a thinking budget is refused alone; a free request keeps its budget, and one that
    says `enable_in_reasoning=False` itself keeps its grammar after the thinking (and may have a budget)."""
    grammars = [f'start: THOUGHT "</think>" %json {json.dumps(SCHEMA)}\nTHOUGHT: /[a-z]{{{n},{n + 3}}}/\n' for n in (2, 3, 4)]

    def params(grammar: str, per_request: bool | None) -> SamplingParams:
        so = StructuredOutputsParams(grammar=grammar, backend="llguidance", enable_in_reasoning=per_request)
        return SamplingParams(max_tokens=48, temperature=0, structured_outputs=so)

    own = engine(model_dir)
    wide = engine(model_dir, structured_outputs_config={"enable_in_reasoning": True})
    try:
        free = (THINK, SamplingParams(max_tokens=16, temperature=0, thinking_token_budget=2))
        after = (THINK, SamplingParams(max_tokens=48, temperature=0, thinking_token_budget=BUDGET,
                                       structured_outputs=StructuredOutputsParams(json=SCHEMA, enable_in_reasoning=False)))
        want = run(own, {**{f"g{i}": (THINK, params(g, True)) for i, g in enumerate(grammars)}, "free": free, "after": after})
        with pytest.raises(ParamError, match="thinking_token_budget.*enable_in_reasoning"):
            wide.add_request("budget", THINK, guided(thinking_token_budget=BUDGET))
        got = run(wide, {**{f"g{i}": (THINK, params(g, None)) for i, g in enumerate(grammars)}, "free": free, "after": after})
    finally:
        own.shutdown()
        wide.shutdown()
    for i in range(len(grammars)):
        c = got[f"g{i}"].outputs[0]
        assert c.token_ids == want[f"g{i}"].outputs[0].token_ids
        assert c.reasoning is not None and 2 + i <= len(c.reasoning) <= 5 + i and c.reasoning.isalpha()
        check_answer(c)
    assert got["free"].outputs[0].token_ids == want["free"].outputs[0].token_ids  # its budget as without the switch
    assert got["free"].outputs[0].num_reasoning_tokens == 2 + 3  # the budget, then the forced "</think>" (3 tokens)
    assert got["after"].outputs[0].token_ids == want["after"].outputs[0].token_ids
    assert got["after"].outputs[0].num_reasoning_tokens == BUDGET + 3
    check_answer(got["after"].outputs[0])


def test_without_a_parser_nothing_changes(model_dir: Path, reference: dict[str, RequestOutput]) -> None:
    eng = engine(model_dir, reasoning_parser=None)
    try:
        c = run(eng, {"r": (THINK, guided(thinking_token_budget=BUDGET))})["r"].outputs[0]
    finally:
        eng.shutdown()
    assert c.reasoning is None and c.content is None and c.num_reasoning_tokens == 0
    jsonschema.validate(json.loads(c.text), SCHEMA)  # the grammar ran from the first token
    assert c.token_ids != reference["guided"].outputs[0].token_ids


@pytest.mark.parametrize("mode", ["sync", "ahead"])
def test_sampled_n_and_mixed_batch(mode: str, model_dir: Path) -> None:
    """n = 2 sampled thinking sequences beside a closed block, a free request and an abort mid-thought: each
    sequence splits right, each answer validates."""
    eng = engine(model_dir, **MODES[mode])
    try:
        eng.add_request("gone", THINK, SamplingParams(max_tokens=200, temperature=0.9, seed=1))
        for _ in range(3):
            eng.step()
        eng.abort_request("gone")
        outs = run(eng, {
            "n2": (THINK, SamplingParams(n=2, max_tokens=48, temperature=0.8, seed=7, thinking_token_budget=4,
                                         structured_outputs=StructuredOutputsParams(json=SCHEMA))),
            "closed": (NO_THINK, guided(thinking_token_budget=2)),
            "free": (THINK, SamplingParams(max_tokens=12, temperature=0.7, seed=2, thinking_token_budget=3)),
        })
    finally:
        eng.shutdown()
    assert "gone" not in outs
    for c in outs["n2"].outputs:
        check_answer(c)
        assert c.num_reasoning_tokens >= 4 + 3 and c.reasoning and c.text.startswith(c.reasoning + "</think>")
    check_answer(outs["closed"].outputs[0])
    free = outs["free"].outputs[0]
    assert free.num_reasoning_tokens >= 6 and free.content is not None
    assert free.text == free.reasoning + "</think>" + free.content


def test_final_only_outputs_split_as_cumulative_ones(model_dir: Path, reference: dict[str, RequestOutput]) -> None:
    """LLM.generate reports only final outputs (text decoded once, at the end): the same split."""
    from tandem import LLM

    llm = LLM(str(model_dir), dtype="float32", progress=False, max_model_len=1024, reasoning_parser="generic")
    try:
        outs = llm.generate([THINK, THINK], [guided(thinking_token_budget=BUDGET),
                                             SamplingParams(max_tokens=20, temperature=0)], use_tqdm=False)
    finally:
        llm.shutdown()
    for out, rid in zip(outs, ["guided", "long"], strict=True):
        want, got = reference[rid].outputs[0], out.outputs[0]
        assert (got.text, got.reasoning, got.content) == (want.text, want.reasoning, want.content)


def test_streamed_reasoning_only_grows(model_dir: Path) -> None:
    """Cumulative outputs step by step: reasoning and content only ever grow, and no content before the end."""
    eng = engine(model_dir)
    eng.add_request("r", THINK, guided(thinking_token_budget=BUDGET))
    last = ("", "")
    try:
        while eng.has_unfinished_requests():
            for o in eng.step():
                c = o.outputs[0]
                r, a = c.reasoning or "", c.content or ""
                assert r.startswith(last[0]) and a.startswith(last[1])
                assert not a or c.num_reasoning_tokens == BUDGET + 3
                last = (r, a)
    finally:
        eng.shutdown()
    assert last[1]


def test_it_thinks_while_its_grammar_compiles(model_dir: Path, reference: dict[str, RequestOutput],
                                              held_compiles: threading.Event) -> None:
    """The synchronous step: a thinking request does not wait for its grammar; it is held only when its thinking
    ends first, and its answer then starts under the grammar, as if the compile had been instant."""
    eng = engine(model_dir)
    params = SamplingParams(max_tokens=48, temperature=0, thinking_token_budget=BUDGET,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, backend="llguidance"))
    eng.add_request("r", THINK, params)
    try:
        req = eng._seqs["r"].req
        for _ in range(40):
            eng.step()
            if req.num_output_tokens >= BUDGET + 3:
                break
        assert eng.guidance.has_pending and req.hold_sampling  # thought all it may, now waits for the grammar
        for _ in range(3):
            eng.step()
        assert req.num_output_tokens == BUDGET + 3
        held_compiles.set()
        out = run(eng, {})["r"].outputs[0]
    finally:
        held_compiles.set()
        eng.shutdown()
    want = reference["guided"].outputs[0]
    assert out.token_ids[: BUDGET + 3] == want.token_ids[: BUDGET + 3]
    check_answer(out)


@pytest.mark.demo
@pytest.mark.slow
def test_demo_model_with_the_generic_parser(demo_model_dir: Path) -> None:
    """The real demo model (SmolLM2's tokenizer and chat template) as `tandem demo` runs it: the prompt opens
    `<think>`, the budget forces the end marker, the schema holds the answer; synchronous and scheduled ahead."""
    from tandem.demo.structured import PERSON, TEXTS
    from tandem.engine.llm import build_engine

    outs: dict[str, CompletionOutput] = {}
    for mode in ("sync", "ahead"):
        eng = build_engine(str(demo_model_dir), dtype="bfloat16", progress=False, max_model_len=1024,
                           kv_cache_memory=64 * 2**20, reasoning_parser="generic", **MODES[mode])
        try:
            tok = eng.tokenizer
            prompt = tok.render_chat([{"role": "user", "content": f"Extract the person as JSON. {TEXTS[0]}"}]) + "<think>\n"
            params = SamplingParams(temperature=0, max_tokens=120, thinking_token_budget=16,
                                    structured_outputs=StructuredOutputsParams(json=PERSON))
            outs[mode] = run(eng, {"r": (tok.encode(prompt, add_special_tokens=False), params)})["r"].outputs[0]
        finally:
            eng.shutdown()
    end_ids = list(build_markers_ids(demo_model_dir))
    for c in outs.values():  # (bf16: the two paths compute the last prompt token in different kernels, so their
        # tokens may part; token equality of the paths is checked in float32 above)
        assert c.token_ids[16 : 16 + len(end_ids)] == end_ids and c.num_reasoning_tokens == 16 + len(end_ids)
        assert c.finish_reason == "stop" and c.reasoning is not None
        jsonschema.validate(json.loads(c.content or ""), PERSON)


def build_markers_ids(folder: Path) -> tuple[int, ...]:
    from tandem.reasoning import Reasoner
    from tandem.tokenizer import Tokenizer

    return Reasoner("generic", Tokenizer.from_path(folder)).markers.end_ids


def test_an_implicit_end_before_the_grammar_compiled_reaches_the_grammar(model_dir: Path,
                                                                          held_compiles: threading.Event) -> None:
    """The thinking ends on a token that is the answer's (an implicit end, as Qwen3's `<tool_call>`) while the
    grammar still compiles: the grammar takes that token once it is ready, so the answer is one valid document."""
    eng = engine(model_dir, reasoning_parser={"name": "generic", "implicit_ends": ["{"]})
    brace = eng.tokenizer.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    params = SamplingParams(max_tokens=48, temperature=0, logit_bias={brace[0]: 40.0},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, backend="llguidance"))
    eng.add_request("r", THINK, params)
    try:
        req = eng._seqs["r"].req
        for _ in range(5):
            eng.step()
        assert req.num_output_tokens == 1 and req.hold_sampling  # "{" ended the thinking; the grammar compiles
        held_compiles.set()
        c = run(eng, {})["r"].outputs[0]
    finally:
        held_compiles.set()
        eng.shutdown()
    assert c.reasoning == "" and c.num_reasoning_tokens == 0 and c.content == c.text
    check_answer(c)


@pytest.mark.demo
@pytest.mark.slow
def test_demo_model_32_distinct_schemas_after_thinking_at_once(demo_model_dir: Path) -> None:
    """32 requests at once, each its own schema (tandem/bench/schemas.py) and one of four budgets (0, 8, 16, 32):
    each thinks exactly its budget plus the forced marker, then answers a document valid against its schema."""
    from tandem.bench.schemas import describe, distinct_schemas
    from tandem.engine.llm import build_engine

    eng = build_engine(str(demo_model_dir), dtype="bfloat16", progress=False, max_model_len=2048, max_num_seqs=32,
                       kv_cache_memory=256 * 2**20, reasoning_parser="generic")
    schemas = distinct_schemas(32, seed=11)
    budgets = [(0, 8, 16, 32)[i % 4] for i in range(len(schemas))]
    end = len(eng.thinking.reasoner.markers.end_ids)
    try:
        tok = eng.tokenizer
        requests = {
            f"r{i}": (tok.encode(tok.render_chat([{"role": "user", "content": describe(s)}]) + "<think>\n",
                                 add_special_tokens=False),
                      SamplingParams(temperature=0, max_tokens=400, thinking_token_budget=budgets[i],
                                     structured_outputs=StructuredOutputsParams(json=s)))
            for i, s in enumerate(schemas)}
        outs = run(eng, requests)
    finally:
        eng.shutdown()
    for i, schema in enumerate(schemas):
        c = outs[f"r{i}"].outputs[0]
        assert c.finish_reason == "stop" and c.num_reasoning_tokens == budgets[i] + end, (i, c)
        jsonschema.validate(json.loads(c.content or ""), schema)
