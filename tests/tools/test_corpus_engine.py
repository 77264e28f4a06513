"""Tool calls over the function corpus (130 real-world definitions) through the engine, rendered and constrained as
the server does it (ToolPlan, the structural-tag grammar), every call parsed and validated against its function's
schema as the client wrote it: `tandem bench tools`' own run_corpus, 32 requests in flight, a distinct three-function
tool set for every "required" and "auto" request.

The model is the tiny random-weight Qwen2 with Qwen 2.5's tools-aware template (tests/tools/tiny_model.py): its
forward costs nothing, so the run measures the grammar machinery, and a random model is a harsh driver of it (it
picks among everything the grammar allows: odd unicode, escapes, extreme numbers). It is sampled (a seed per request)
with the tokens that close strings, arrays and objects pushed by logit_bias, so values stay short and every request
ends; the auto-mode trigger token is pushed too, so auto requests write some free text and then, mostly, a call.
Nothing may be invalid or end in an error: every named and required request that ends within max_tokens is exactly
one call that validates, and every auto call made validates. A random model cannot end a string held to a
`pattern` or `format` (uri, email, ...) except by chance, so such calls run into max_tokens now and then: they are
counted apart ("length", never valid) and must stay rare.

The same corpus on the demo model (greedy, both backends, every mode for every definition): `tandem bench tools`,
figures in docs/tool_calling.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.bench.tools import load_functions, report_rows, run_corpus
from tandem.engine.llm import build_engine
from tandem.tools.plan import grammar_schema, xgrammar_gaps
from tests.tools.tiny_model import TOOL_TOKENS

CLOSERS = set('"]},')


@pytest.fixture(scope="module")
def engine(tool_model_dir: Path) -> Any:
    engine = build_engine(str(tool_model_dir), dtype="float32", max_model_len=2048, max_num_seqs=32, progress=False)
    yield engine
    engine.shutdown()


def _bias(engine: Any) -> dict[int, float]:
    """+9 for the tokens made only of closing characters (and the tool-call trigger)."""
    tok = engine.tokenizer
    hf = tok.hf
    out = {i: 9.0 for i in range(len(hf)) if (t := hf.decode([i]).strip()) and set(t) <= CLOSERS}
    out[hf.convert_tokens_to_ids(TOOL_TOKENS[0])] = 9.0
    return out


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_corpus_calls_validate(engine: Any, backend: str) -> None:
    functions = load_functions()
    assert len(functions) >= 100
    if backend == "xgrammar":  # what it ignores (fractional multipleOf) is served by llguidance unless xgrammar is asked for
        functions = [f for f in functions if not xgrammar_gaps(grammar_schema(f["function"]["parameters"]))]
    every = {"named": 1, "required": 4, "auto": 6} if backend == "llguidance" else {"named": 16, "required": 16, "auto": 24}
    report = run_corpus(engine, functions, backend, every=every, max_tokens=160,
                        sampling={"temperature": 1.0, "logit_bias": _bias(engine)})
    for row in report_rows(report):
        print(row)
    tallies = report["tallies"]
    for mode, t in tallies.items():
        assert t.counts["invalid"] == 0 and t.counts["error"] == 0, (mode, t.notes)
    for mode in ("named", "required"):
        n, counts = len(range(0, len(functions), every[mode])), tallies[mode].counts
        assert counts["valid"] + counts["length"] == n and counts["length"] <= n // 10, (counts, tallies[mode].notes)
    auto = tallies["auto"]
    assert auto.calls >= len(range(0, len(functions), every["auto"])) // 2, auto.counts  # most auto requests call
