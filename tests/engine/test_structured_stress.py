"""Structured outputs under mixed load, one batch through the engine: 32 distinct JSON schemas on both backends,
speculation (n-gram drafts cut by the grammars, forced tokens as drafts), n > 1, stop strings and min_tokens, on
stories260K (which knows no JSON: the masks do the work). Every output is checked whatever ended it: its tokens by
fresh matchers of both backends, complete documents by jsonschema, stop-string and max_tokens cuts as prefixes;
greedy requests give the same tokens as without speculation."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams, StructuredOutputsParams

from ..structured.oracle import GrammarOracle
from .test_engine import run_all

NUM_SCHEMAS = 32
STOP = '",'  # inside documents: cuts a string value followed by another member


def make_schema(i: int) -> dict[str, Any]:
    """A distinct object schema: 2-4 members of mixed types, some required, no extra keys."""
    rng = random.Random(i)
    kinds = [
        {"type": "string", "maxLength": rng.randint(2, 10)},
        {"type": "integer", "minimum": -rng.randint(0, 50), "maximum": rng.randint(0, 500)},
        {"type": "boolean"},
        {"enum": [f"v{i}", "x", rng.randint(0, 9)]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(1, 3)},
        {"type": "object", "properties": {"z": {"type": "string", "maxLength": 4}}, "required": ["z"],
         "additionalProperties": False},
    ]
    names = rng.sample(["a", "bb", "id", "name", "k", "value", "tag", "n"], rng.randint(2, 4))
    props = {n: rng.choice(kinds) for n in names}
    return {"type": "object", "properties": props, "required": names[: rng.randint(1, len(names))],
            "additionalProperties": False, "title": f"s{i}"}


def make_params(i: int) -> SamplingParams:
    so = StructuredOutputsParams(json=make_schema(i), backend=("xgrammar", "llguidance", "auto")[i % 3])
    greedy = i % 4 == 0
    return SamplingParams(
        temperature=0.0 if greedy else 1.0, seed=None if greedy else 100 + i, n=1 if greedy or i % 3 else 2,
        max_tokens=(24, 60, 120)[i % 3], min_tokens=3 if i % 2 else 0, stop=[STOP] if i % 5 == 1 else None,
        structured_outputs=so,
    )


@pytest.fixture(scope="module")
def oracle(stories_dir) -> GrammarOracle:  # type: ignore[no-untyped-def]
    from tandem.tokenizer import Tokenizer

    tok = Tokenizer.from_path(stories_dir)
    return GrammarOracle(tok.hf, 512, tok.eos_token_ids)


def _run(engine: LLMEngine) -> dict[str, Any]:
    prompts = ["Once upon a time", "Tom and Lily", "The little dog", "One day"]
    for i in range(NUM_SCHEMAS):
        engine.add_request(f"s{i}", prompts[i % len(prompts)], make_params(i))
    return run_all(engine, {})


@pytest.mark.slow
def test_32_schemas_with_speculation_n_stop_strings_and_min_tokens(stories_engine_factory, oracle: GrammarOracle) -> None:  # type: ignore[no-untyped-def]
    spec = stories_engine_factory(max_model_len=512, max_num_seqs=64,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    done = _run(spec)
    ended: dict[str, int] = {"eos": 0, "stop-string": 0, "length": 0}
    for i in range(NUM_SCHEMAS):
        out, p = done[f"s{i}"], make_params(i)
        assert out.error is None and len(out.outputs) == p.n, (i, out.error)
        assert p.structured_outputs is not None
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length"), (i, o.finish_reason)
            by_eos = o.finish_reason == "stop" and o.stop_reason is None
            oracle.accepts(p.structured_outputs, o.token_ids, complete=by_eos)
            assert len(o.token_ids) >= p.min_tokens
            if by_eos:
                jsonschema.validate(json.loads(o.text), make_schema(i))
                ended["eos"] += 1
            elif o.finish_reason == "stop":
                assert o.stop_reason == STOP and STOP not in o.text and p.stop == (STOP,)
                ended["stop-string"] += 1
            else:
                assert len(o.token_ids) == p.max_tokens
                ended["length"] += 1
    assert all(ended.values()), ended  # each way of ending was exercised (and checked)
    stats = spec.get_stats()
    assert stats["spec_num_drafted"] > 0 and stats["guided_forced_tokens"] > 0
    assert spec.block_manager.num_free_blocks == spec.runner.num_blocks
    # greedy requests: the same tokens without speculation (lossless under grammars)
    base = _run(stories_engine_factory(max_model_len=512, max_num_seqs=64))
    for i in range(0, NUM_SCHEMAS, 4):
        assert done[f"s{i}"].outputs[0].token_ids == base[f"s{i}"].outputs[0].token_ids, i
