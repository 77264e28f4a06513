"""Hostile structured outputs through the whole engine on the demo model: ~250 inputs built to break a grammar
backend (tests/structured/hostile_corpus.py) and hypothesis-generated regexes and schemas, sent beside normal
requests. Each one is refused at submit (ParamError: a 4xx) or ends with a finish reason ("error" with its reason
included); the engine's step never raises; the normal requests complete with valid output."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.engine import LLMEngine
from tandem.params import ParamError, SamplingParams, StructuredOutputsParams
from tandem.request import RequestOutput

from ..structured.hostile_corpus import corpus

pytestmark = [pytest.mark.slow, pytest.mark.demo]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(demo_model_dir: Any) -> LLMEngine:
    from tandem.engine.llm import build_engine

    return build_engine(str(demo_model_dir), dtype="bfloat16", max_model_len=768, max_num_seqs=48, num_kv_blocks=1200,
                        structured_outputs_config={"compile_timeout_s": 1.0, "max_fill_ms": 200.0}, progress=False)


def _normal(engine: LLMEngine) -> dict[str, tuple[Any, SamplingParams]]:
    tok = engine.tokenizer
    out = {}
    for i in range(4):
        ask = tok.apply_chat_template([{"role": "user", "content": f"Person {i}: Ann, {30 + i}. As JSON:"}])
        out[f"normal-json-{i}"] = (ask, SamplingParams(temperature=0, max_tokens=48,
                                                       structured_outputs=StructuredOutputsParams(json=PERSON)))
        out[f"normal-text-{i}"] = (ask, SamplingParams(temperature=0, max_tokens=24))
    return out


def _run(engine: LLMEngine, requests: dict[str, tuple[Any, SamplingParams]], deadline_s: float) -> dict[str, RequestOutput]:
    """Run the requests to the end; a request refused at add_request (a 400 / 429 in the server) is left out."""
    done: dict[str, RequestOutput] = {}
    added = set()
    for rid, (prompt, params) in requests.items():
        try:
            engine.add_request(rid, prompt, params)
            added.add(rid)
        except ParamError:
            pass
    t0 = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - t0 < deadline_s, f"still running: {engine.num_unfinished_requests}"
        for out in engine.step():  # never raises, whatever the requests carry
            if out.finished:
                done[out.request_id] = out
    assert set(done) == added
    return done


def _check_normal(done: dict[str, RequestOutput]) -> None:
    for rid, out in done.items():
        if not rid.startswith("normal-"):
            continue
        c = out.outputs[0]
        assert out.error is None and c.finish_reason in ("stop", "length"), (rid, out.error)
        if rid.startswith("normal-json") and c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)


def _hostile_requests(engine: LLMEngine, entries: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    """Requests for the entries that pass validation; the names of those refused at once (a 400 in the server)."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Answer."}])
    requests: dict[str, Any] = {}
    refused = []
    for i, (name, body) in enumerate(entries):
        try:
            params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(**body))
        except (ParamError, TypeError):
            refused.append(name)
            continue
        requests[f"hostile-{i}"] = (prompt, params)
    return requests, refused


def test_hostile_corpus_beside_normal_requests(engine: LLMEngine) -> None:
    entries = corpus()
    assert len(entries) >= 200
    hostile, refused = _hostile_requests(engine, entries)
    t0 = time.monotonic()
    done = _run(engine, {**_normal(engine), **hostile}, deadline_s=600)
    refused += [rid for rid in hostile if rid not in done]
    _check_normal(done)
    reasons = [o.outputs[0].finish_reason for rid, o in done.items() if rid.startswith("hostile-")]
    assert set(reasons) <= {"stop", "length", "error"}
    errors = [o for o in done.values() if o.outputs[0].finish_reason == "error"]
    assert all(o.error for o in errors)  # an error always says why
    stats = engine.get_stats()
    print(f"\nhostile corpus: {len(entries)} inputs; refused at submit {len(refused)}; ran {len(reasons)} "
          f"(error {reasons.count('error')}, stop {reasons.count('stop')}, length {reasons.count('length')}); "
          f"grammar fill errors {stats.get('grammar_fill_errors')}, compile timeouts {stats.get('grammar_timeouts')}, "
          f"slow fills {stats.get('grammar_slow_fills')}; {time.monotonic() - t0:.1f} s")
    # the engine still serves guided requests normally afterwards
    again = _run(engine, _normal(engine), deadline_s=120)
    _check_normal(again)


# -------------------------------------------------------------------------------------------- hypothesis fuzzing
_REGEX_ATOMS = st.sampled_from(["a", "b", ".", "\\d", "\\w", "\\s", "[a-z]", "[^x]", "(a|b)", "\\p{L}", "é", "\\.", "x"])


@st.composite
def regexes(draw: st.DrawFn, depth: int = 3) -> str:
    """Random regexes from atoms, concatenation, alternation, groups and (nested) bounded / unbounded repetition."""
    if depth == 0:
        return draw(_REGEX_ATOMS)
    parts = draw(st.lists(st.one_of(_REGEX_ATOMS, regexes(depth=depth - 1)), min_size=1, max_size=3))
    body = "".join(parts)
    op = draw(st.sampled_from(["", "*", "+", "?", "{2}", "{1,40}", "{0,300}", "|b", "group"]))
    if op == "group":
        return f"({body})"
    if op == "|b":
        return f"(?:{body}|b)"
    return f"({body}){op}" if op else body


_SCALARS = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                            {"type": "null"}, {"type": "string", "maxLength": 5}, {"enum": ["a", "b", 1]},
                            {"type": "integer", "minimum": 3, "maximum": 2}, {"const": "x"}])


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Random JSON schemas: nested objects / arrays / anyOf of scalars, some unsatisfiable."""
    return st.recursive(
        _SCALARS,
        lambda inner: st.one_of(
            st.builds(lambda props: {"type": "object", "properties": props, "required": list(props)[:1]},
                      st.dictionaries(st.text(min_size=1, max_size=8), inner, min_size=1, max_size=4)),
            st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 5)),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        ),
        max_leaves=12,
    )


# two examples of 40-60 generated grammars each, run as one batch per example (the engine's way to go fast)
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(bodies=st.lists(st.one_of(st.builds(lambda r, b: {"regex": r, "backend": b}, regexes(), st.sampled_from(["auto", "xgrammar", "llguidance"])),
                                 st.builds(lambda s, b: {"json": s, "backend": b}, schemas(), st.sampled_from(["auto", "xgrammar", "llguidance"]))),
                       min_size=40, max_size=60))
def test_generated_grammars_beside_normal_requests(engine: LLMEngine, bodies: list[dict[str, Any]]) -> None:
    hostile, _ = _hostile_requests(engine, [(f"gen-{i}", b) for i, b in enumerate(bodies)])
    normal = dict(list(_normal(engine).items())[:2])
    done = _run(engine, {**normal, **hostile}, deadline_s=300)
    _check_normal(done)
    for rid in hostile:
        assert done[rid].outputs[0].finish_reason in ("stop", "length", "error")
