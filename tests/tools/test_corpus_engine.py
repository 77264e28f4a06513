"""Tool calls over the function corpus (130 real-world definitions) through the engine, rendered and constrained as
the server does it (ToolPlan: the demo template knows no tools, so the fallback prompt; the structural-tag grammar),
every call parsed and validated against its function's schema as written: `tandem bench tools`' own run_corpus.

In `make test`: llguidance (the backend `auto` routes new grammars to), a named call for every definition and a
"required" and an "auto" request over a distinct three-function set for every 4th. The whole corpus in every mode
on both backends is `tandem bench tools` (figures in docs/tool_calling.md).

Calls cut by max_tokens cannot be complete (a 135M model now and then loops in an unbounded array or string): they
are counted apart, never as valid, and must stay rare. Nothing may be invalid or end in an error.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.bench.tools import load_functions, report_rows, run_corpus
from tandem.engine.llm import build_engine
from tests.server.test_server import demo


@pytest.fixture(scope="module")
def engine() -> Any:
    engine = build_engine(None, dtype="bfloat16", max_model_len=4096, max_num_seqs=32, progress=False)
    yield engine
    engine.shutdown()


@demo
def test_corpus_calls_validate(engine: Any) -> None:
    functions = load_functions()
    assert len(functions) >= 100
    report = run_corpus(engine, functions, "llguidance", every={"named": 1, "required": 4, "auto": 4})
    for row in report_rows(report):
        print(row)
    tallies = report["tallies"]
    for mode, t in tallies.items():
        assert t.counts["invalid"] == 0 and t.counts["error"] == 0, (mode, t.notes)
    named, required = tallies["named"].counts, tallies["required"].counts
    assert named["valid"] + named["length"] == len(functions) and named["length"] <= len(functions) // 20, tallies["named"].notes
    assert required["valid"] + required["length"] == len(range(0, len(functions), 4)) and required["length"] <= 2
    assert tallies["auto"].counts["text"] + tallies["auto"].counts["valid"] + tallies["auto"].counts["length"] > 0
