"""Structured outputs through the whole engine: every kind and backend gives valid output, also on a model whose
logits are near-random; guided and unguided requests mix; failures stay with their request.

Every output is checked whatever it ended with (tests/structured/oracle.py): its tokens by fresh matchers of both
backends (the other backend is an independent implementation), its text by `json` / `jsonschema` when complete and
by the `regex` module's partial matching when cut by max_tokens or a stop string."""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence

import jsonschema
import pytest

from tandem.engine.engine import LLMEngine
from tandem.params import ParamError, SamplingParams, StructuredOutputsParams
from tandem.request import CompletionOutput
from tandem.spec_decode.registry import register_proposer

from ..structured.oracle import GrammarOracle, check_text, choice_pattern
from .scripted import ScriptedProposer
from .test_engine import run_all

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GBNF = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [0-9]+\n'
LARK = 'start: "(" expr ")"\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[0-9]+/\n'
EXPR = re.compile(r"\(\d+([+*]\d+)*\)")
PATTERNS = {"regex": r"[a-z]{2,5}-\d{2}", "choice": choice_pattern(["red", "green", "blue"]), "gbnf": EXPR.pattern,
            "lark": EXPR.pattern}


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{2,5}-\d{2}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue")
    else:
        assert EXPR.fullmatch(text), text


def _params(kind: str, backend: str) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=SCHEMA, backend=backend)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, backend=backend)
    if kind == "regex":
        return StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{2}", backend=backend)
    if kind == "choice":
        return StructuredOutputsParams(choice=["red", "green", "blue"], backend=backend)
    if kind == "gbnf":
        return StructuredOutputsParams(grammar=GBNF, backend=backend)
    return StructuredOutputsParams(grammar=LARK, backend=backend)


def _verify(oracle: GrammarOracle, kind: str, so: StructuredOutputsParams, o: CompletionOutput) -> bool:
    """Check one output, complete or cut; True when the grammar ended it (EOS)."""
    complete = o.finish_reason == "stop" and o.stop_reason is None
    assert o.finish_reason in ("stop", "length"), (o.finish_reason, o.text)
    oracle.accepts(so, o.token_ids, complete)
    check_text(kind, o.text, complete, schema=SCHEMA, pattern=PATTERNS.get(kind))
    return complete


KINDS = ["json", "json_object", "regex", "choice", "gbnf", "lark"]
CASES = [(k, b) for k in KINDS for b in ("xgrammar", "llguidance") if not (k == "lark" and b == "xgrammar")]


@pytest.fixture(scope="module")
def stories(stories_engine_factory) -> LLMEngine:  # type: ignore[no-untyped-def]
    return stories_engine_factory(max_model_len=512)


@pytest.fixture(scope="module")
def stories_oracle(stories: LLMEngine) -> GrammarOracle:
    return GrammarOracle(stories.tokenizer.hf, stories.vocab_size, stories.eos_token_ids)


@pytest.mark.parametrize("kind,backend", CASES)
def test_every_kind_and_backend_valid(stories: LLMEngine, stories_oracle: GrammarOracle, kind: str, backend: str) -> None:
    """stories260K knows no JSON or grammar: its logits are effectively random here, which stresses the masks."""
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=200, n=3, structured_outputs=_params(kind, backend))
    out = run_all(stories, {"g": "Once upon a time"}, p)["g"]
    assert out.error is None and out.metrics is not None and out.metrics.grammar_backend == backend
    assert p.structured_outputs is not None
    for o in out.outputs:  # complete, or cut by max_tokens ("length"): a checked prefix
        _verify(stories_oracle, kind, p.structured_outputs, o)


def test_mixed_batch_and_greedy_mask_modes_agree(stories_engine_factory, stories_oracle: GrammarOracle) -> None:  # type: ignore[no-untyped-def]
    prompts = {f"u{i}": "Once upon a time" for i in range(3)} | {f"g{i}": "Tom and Lily" for i in range(3)}
    so = StructuredOutputsParams(json=SCHEMA)

    def run(mode: str) -> dict[str, list[int]]:
        engine = stories_engine_factory(max_model_len=512, structured_mask_mode=mode)
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=60,
                                                      structured_outputs=so if rid.startswith("g") else None))
        done = run_all(engine, {})
        for rid, out in done.items():
            if rid.startswith("g"):
                _verify(stories_oracle, "json", so, out.outputs[0])
        return {rid: out.outputs[0].token_ids for rid, out in done.items()}

    cpu, device = run("cpu"), run("device")
    assert cpu == device
    unguided = run_all(stories_engine_factory(max_model_len=512), {"u": "Once upon a time"},
                       SamplingParams(temperature=0.0, max_tokens=60))["u"].outputs[0].token_ids
    assert cpu["u0"] == unguided  # guided neighbours do not change an unguided request


def test_eos_only_where_grammar_accepts(stories: LLMEngine) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    o = run_all(stories, {"c": "Once"}, p)["c"].outputs[0]
    assert o.text in ("yes", "no") and o.finish_reason == "stop"
    p = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    o = run_all(stories, {"l": "Once"}, p)["l"].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3


def test_bad_grammar_fails_alone(stories: LLMEngine) -> None:
    stories.add_request("ok", "Once", SamplingParams(temperature=0.0, max_tokens=20))
    stories.add_request("bad", "Once", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        grammar="root ::= undefined_rule", backend="xgrammar")))
    done = run_all(stories, {})
    assert done["bad"].error and "xgrammar" in done["bad"].error
    assert done["bad"].outputs[0].finish_reason == "error"
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 20
    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20000)}}
    with pytest.raises(ParamError, match="limit"):
        stories.add_request("huge", "Once", SamplingParams(structured_outputs=StructuredOutputsParams(json=big)))
    assert not stories.has_unfinished_requests()


def test_compile_timeout_isolated(stories_engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A compile that keeps burning CPU (a stand-in for a grammar bomb, which never finishes first whatever the
    machine's speed) ends its request alone with "timed out"; the other request completes."""
    import threading

    from tandem.structured.llguidance_backend import LLGuidanceBackend

    release = threading.Event()
    real_compile = LLGuidanceBackend.compile

    def burning_compile(self, spec):  # type: ignore[no-untyped-def]
        if "bomb" not in spec.text:
            return real_compile(self, spec)
        while not release.is_set():  # CPU time of the compiling thread, until the test ends
            sum(range(1000))
        raise AssertionError("released")

    monkeypatch.setattr(LLGuidanceBackend, "compile", burning_compile)
    engine = stories_engine_factory(max_model_len=512, structured_outputs_config={"compile_timeout_s": 0.05,
                                                                                 "isolate_compiles": False})
    try:
        engine.add_request("ok", "Once", SamplingParams(temperature=0.0, max_tokens=10))
        bomb = {"type": "object", "properties": {"bomb": {"type": "string"}}, "required": ["bomb"]}
        engine.add_request("slow", "Once", SamplingParams(structured_outputs=StructuredOutputsParams(json=bomb, backend="llguidance")))
        done = run_all(engine, {})
    finally:
        release.set()
    assert "timed out" in (done["slow"].error or "") and done["slow"].outputs[0].finish_reason == "error"
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 10
    assert engine.get_stats()["grammar_timeouts"] == 1


def test_speculation_with_grammar_validates(stories_engine_factory, stories_oracle: GrammarOracle) -> None:  # type: ignore[no-untyped-def]
    engine = stories_engine_factory(max_model_len=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    p = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    base = stories_engine_factory(max_model_len=512)
    want = run_all(base, {"a": "Once upon a time"}, p)["a"].outputs[0]
    got = run_all(engine, {"a": "Once upon a time"}, p)["a"].outputs[0]
    assert got.token_ids == want.token_ids
    assert p.structured_outputs is not None
    _verify(stories_oracle, "json", p.structured_outputs, got)
    assert engine.get_stats()["guided_forced_tokens"] > 0


def test_request_params_are_plain_data() -> None:
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), stop=["x"], seed=3)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.structured_outputs is not None and json.loads(q.structured_outputs.json or "") == SCHEMA


@pytest.mark.demo
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_demo_model_kinds_validate(demo_model_dir, backend: str) -> None:  # type: ignore[no-untyped-def]
    from tandem.engine.llm import build_engine

    engine = build_engine(str(demo_model_dir), dtype="bfloat16", max_model_len=1024, progress=False)
    tok = engine.tokenizer
    # a prompt the model answers the same way in bf16 and float32 (a looser one hit a near-tie after `{"name":`)
    question = 'Reply with a JSON object with keys "name" (Ann) and "age" (31).'
    prompt = tok.apply_chat_template([{"role": "user", "content": question}])
    for kind in KINDS:
        if kind == "lark" and backend == "xgrammar":
            continue
        p = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=_params(kind, backend))
        o = run_all(engine, {kind: prompt}, p)[kind].outputs[0]
        assert o.finish_reason == "stop", (kind, o.text)
        _check(kind, o.text)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory, shared_data) -> LLMEngine:  # type: ignore[no-untyped-def]
    """A random-weight Llama over the real GPT-2 vocabulary: its logits are noise, so the grammar does all the work."""
    import shutil

    import torch
    import transformers

    from tandem.engine.llm import build_engine
    from tandem.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("random-gpt2")
    for name in ("vocab.json", "merges.txt"):  # a GPT-2 folder: tandem's Tokenizer builds byte-level BPE from these
        shutil.copy(shared_data / "tokenizers" / "gpt2" / name, d / name)
    tok = Tokenizer.from_path(d).hf
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return build_engine(str(d), dtype="float32", progress=False, max_model_len=1024)


@pytest.fixture(scope="module")
def random_oracle(random_model: LLMEngine) -> GrammarOracle:
    return GrammarOracle(random_model.tokenizer.hf, random_model.vocab_size, random_model.eos_token_ids)


@pytest.mark.parametrize("kind,backend", CASES)
def test_random_logits_model_stays_valid(random_model: LLMEngine, random_oracle: GrammarOracle, kind: str, backend: str) -> None:
    """Every sampled token passes the matcher (else the request would end with an error) and every output is valid:
    whole documents, and prefixes of one where max_tokens cut them (the unbounded kinds mostly)."""
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=300, n=4, structured_outputs=_params(kind, backend))
    out = run_all(random_model, {"r": "hello world"}, p)["r"]
    assert out.error is None and p.structured_outputs is not None
    complete = [_verify(random_oracle, kind, p.structured_outputs, o) for o in out.outputs]
    if kind in ("choice", "regex"):
        assert any(complete)  # bounded grammars end within 300 tokens even from noise


def test_request_ending_and_grammar_complaint_on_same_token_finishes_once(stories_engine_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Found by fuzzing the server: a sequence that hit max_tokens on a token its matcher refused was finished twice,
    which crashed the engine. It must end once (with its normal reason) and the engine keep serving."""
    engine = stories_engine_factory(max_model_len=512)
    monkeypatch.setattr(engine.guidance, "accept",
                        lambda req, toks, k, unchecked=0: (False, "matcher refused the token" if req.request_id == "a" else None))
    p = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    done = run_all(engine, {"a": "Once"}, p)
    assert done["a"].outputs[0].finish_reason == "length"
    more = run_all(engine, {"b": "Once"}, SamplingParams(temperature=0.0, max_tokens=3))
    assert len(more["b"].outputs[0].token_ids) == 3


# ------------------------------------------------------------------ a grammar with min_tokens / stop_token_ids
# A grammar whose document is complete allows only EOS; min_tokens bans EOS (and stop_token_ids) until it is met.
# vLLM applies both and is left with no token (its matcher then rejects whatever is drawn and the request is
# terminated). tandem ends that request alone with finish_reason "error", keeps the document generated so far
# (the drafts accepted before the dead row included), and says which constraints collided; nothing is drawn from
# a row where no token is allowed, and its blocks are freed.
@pytest.mark.parametrize("speculation", [None, "ngram"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_grammar_complete_before_min_tokens_ends_with_its_document_and_a_clear_error(
    stories_engine_factory, stories_oracle: GrammarOracle, backend: str, speculation: str | None  # type: ignore[no-untyped-def]
) -> None:
    spec = {"method": speculation, "num_speculative_tokens": 3} if speculation else None
    engine = stories_engine_factory(max_model_len=512, speculative_config=spec)
    so = StructuredOutputsParams(choice=["yes", "no"], backend=backend)
    engine.add_request("plain", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    done = run_all(engine, {"short": "Once", "enough": "Once"}, SamplingParams(temperature=0.0, max_tokens=20,
                                                                                min_tokens=3, structured_outputs=so))
    out = done["short"]
    o = out.outputs[0]
    assert o.finish_reason == "error" and out.error is not None
    assert "min_tokens=3" in out.error and "the grammar" in out.error, out.error
    assert o.text in ("yes", "no")  # the whole document, nothing drawn from the dead row
    stories_oracle.accepts(so, o.token_ids, complete=False)
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == 12
    # met in time: the same request with min_tokens 2 ("no" is 2 tokens) ends normally
    ok = run_all(engine, {"ok": "Once"}, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=2, structured_outputs=so))["ok"]
    assert (ok.error, ok.outputs[0].finish_reason, ok.outputs[0].text) == (None, "stop", o.text)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_stop_token_ids_inside_a_grammar(stories_engine_factory, stories_oracle: GrammarOracle) -> None:  # type: ignore[no-untyped-def]
    """A stop token the grammar allows ends the request there ("stop", stop_reason = the id, its text left out):
    a prefix of a document. Under min_tokens the same token is banned, and when the grammar allows nothing else the
    request ends with an error naming both."""
    engine = stories_engine_factory(max_model_len=512)
    so = StructuredOutputsParams(choice=["no"])
    free = run_all(engine, {"f": "Once"}, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so))["f"]
    n_id, o_id, eos = free.outputs[0].token_ids  # "n", "o", EOS: the tokens the grammar walks through here
    assert eos in engine.eos_token_ids
    stop = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[o_id], structured_outputs=so)
    out = run_all(engine, {"s": "Once"}, stop)["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text, out.token_ids) == ("stop", o_id, "n", [n_id, o_id])
    stories_oracle.accepts(so, out.token_ids, complete=False)
    banned = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, stop_token_ids=[o_id], structured_outputs=so)
    res = run_all(engine, {"b": "Once"}, banned)["b"]
    assert res.outputs[0].finish_reason == "error" and res.outputs[0].token_ids == [n_id]
    assert res.error is not None and "min_tokens=5" in res.error and "the grammar" in res.error
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_guided_request_prefills_while_its_grammar_compiles(stories_engine_factory, held_compiles) -> None:  # type: ignore[no-untyped-def]
    """While its grammar compiles, a guided request prefills all but its last prompt token and samples nothing; an
    unguided neighbour decodes meanwhile. Once the grammar is ready it goes on and ends valid."""
    engine = stories_engine_factory(max_model_len=512)
    prompt = engine.tokenizer.encode("Once upon a time, there was a little girl")
    so = StructuredOutputsParams(choice=["yes", "no"], backend="llguidance")
    engine.add_request("g", prompt, SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=so))
    engine.add_request("u", "Tom", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    try:
        for _ in range(6):
            engine.step()
        g = engine._seqs["g"].req
        assert engine.guidance.has_pending and g.hold_sampling
        assert g.num_computed_tokens == len(prompt) - 1 and g.num_output_tokens == 0
        assert engine._seqs["u"].req.num_output_tokens >= 5  # the batch was not blocked
    finally:
        held_compiles.set()
    done = run_all(engine, {})
    assert done["g"].outputs[0].text in ("yes", "no") and done["g"].outputs[0].finish_reason == "stop"


CHOICE = ["Lily ran", "Lily sat", "Tom went to the park"]
STORIES = ["The cat sat on the mat. The dog sat on the mat. The bird ", "Once upon a time", "Lily",
           "Tom had a big red ball. Tom had a big red ball. Tom had a", "One day, Lily went to the park. One day, Lily"]
L, IL, Y = 438, 290, 422  # stories260K's "L", "il", "y"


def _spelling(token_ids: Sequence[int], k: int) -> list[int]:
    """"il" "y" after "L": the non-canonical spelling of a forced "ily" (and nothing else)."""
    return [IL, Y][:k] if token_ids[-1] == L else []


@pytest.mark.parametrize("backend,answer", [("llguidance", ["L", "ily", "s"]), ("xgrammar", ["L", "il", "y"])])
def test_a_greedy_answer_is_the_same_on_every_path(stories_engine_factory, backend: str, answer: list[str]) -> None:  # type: ignore[no-untyped-def]
    """After "L" the choice forces "ily ", and stories260K's argmax after the first prompt is "il" (then "y"), even
    unmasked: a
    tokenization the grammar's bytes allow but not their canonical one. llguidance's mask in a forced run allows the
    canonical token alone ("ily"), xgrammar's every token spelling the bytes. On either backend the answer must not
    depend on the path: masked rows, argmaxes validated unmasked, drafts ("il" "y" after "L", and suffix drafts)
    verified unmasked, scheduled ahead or not. (llguidance's validation took "il" where its mask did not; here the
    unmasked verification's next token, "a", is refused all the same, so the negative control is the backends'
    `test_validation_takes_exactly_what_the_masks_take`.)"""
    register_proposer("spell", lambda **_: ScriptedProposer("spell", _spelling))

    def answers(**engine_args: object) -> list[list[int]]:
        engine = stories_engine_factory(max_model_len=512, **engine_args)
        params = SamplingParams(temperature=0.0, max_tokens=12,
                                structured_outputs=StructuredOutputsParams(choice=CHOICE, backend=backend))
        prompts = {f"r{i}": text for i, text in enumerate(STORIES)}
        done = run_all(engine, prompts, params)
        return [list(done[rid].outputs[0].token_ids) for rid in prompts]

    masked = answers(structured_outputs_config={"unmasked_greedy": False}, async_scheduling=False)
    tok = stories_engine_factory().tokenizer
    assert tok.decode(masked[0]) in CHOICE and [tok.decode([t]) for t in masked[0][:3]] == answer
    cheap = {"unmasked_min_fill_ms": 0.0}  # a 512-token vocabulary: every fill is cheap, skip them all the same
    spell = {"method": "spell", "num_speculative_tokens": 2, "adaptive": False}
    suffix = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "draft_past_outcome": True}
    for ahead in (False, True):
        assert answers(structured_outputs_config=cheap, async_scheduling=ahead, speculative_config=spell) == masked
    assert answers(structured_outputs_config=cheap, async_scheduling=True, speculative_config=suffix) == masked


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "scheduled-ahead"])
def test_a_guided_answer_ends_at_its_grammars_end_despite_ignore_eos(stories_engine_factory, ahead: bool) -> None:  # type: ignore[no-untyped-def]
    """`ignore_eos` with a grammar: the EOS its grammar ends with is the answer's last token, also where a step
    verified drafts past it (EOS drafted after EOS: the masks after the grammar's end allow EOS alone) or the plan
    launched ahead held its row. (The answer ended with two EOS scheduled ahead.)"""
    register_proposer("eos", lambda **_: ScriptedProposer("eos", lambda token_ids, k: [2] * k))  # EOS after EOS
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=CHOICE, backend="llguidance"))
    prompts = {f"r{i}": text for i, text in enumerate(STORIES)}
    want = run_all(stories_engine_factory(max_model_len=512, async_scheduling=False), prompts, params)
    engine = stories_engine_factory(max_model_len=512, async_scheduling=ahead,
                                    speculative_config={"method": "eos", "num_speculative_tokens": 3, "adaptive": False})
    got = run_all(engine, prompts, params)
    eos = engine.tokenizer.eos_token_ids
    for rid in prompts:
        o, w = got[rid].outputs[0], want[rid].outputs[0]
        assert (list(o.token_ids), o.text, o.finish_reason) == (list(w.token_ids), w.text, w.finish_reason), rid
        assert o.token_ids[-1] in eos and sum(t in eos for t in o.token_ids) == 1 and len(o.logprobs) == len(o.token_ids)
    # scheduled ahead, drafts are proposed past the outcome in flight, before the grammar sees them (synchronously
    # the grammar cuts EOS drafts first)
    assert engine.get_stats()["spec_num_accepted"] > 0 or not ahead
