"""`tandem bench serve` bookkeeping: compile-bomb requests in the workload and the report, per-process RSS growth."""

from __future__ import annotations

import json

import pytest

from tandem.bench.serve import RequestResult, bomb_schema, make_workload, summarize, summarize_rss


def test_every_nth_request_is_a_unique_bomb() -> None:
    work = make_workload(["q1", "q2"], ["def f(): pass"], 40, 0.2, 0.2, 32, None, seed=1, bomb_every=10)
    kinds = [r.kind for r in work]
    assert [i for i, k in enumerate(kinds) if k == "bomb"] == [9, 19, 29, 39]
    schemas = [json.dumps(r.body["response_format"]["json_schema"]["schema"]) for r in work if r.kind == "bomb"]
    assert len(set(schemas)) == 4  # unique: no grammar-cache hit, no coalescing with an earlier bomb
    assert all(r.body["stream"] for r in work)


def test_no_bombs_by_default() -> None:
    work = make_workload(["q"], [], 30, 0.5, 0.0, 16, "m", seed=0)
    assert "bomb" not in {r.kind for r in work}
    assert all(r.body["model"] == "m" for r in work)


def test_bomb_schema_pattern_nests_counted_repeats() -> None:
    s = bomb_schema(7, repeat=5)
    assert s["properties"]["id"]["pattern"] == "^((([a-z]{1,5}){1,5}){1,5})$"
    assert s["description"] == "bomb 7"


def test_summary_leaves_bombs_out_of_the_other_figures() -> None:
    ok = RequestResult("plain", True, 0.0, ttft=0.1, e2e=1.0, itl=[0.1, 0.2, 0.3], output_tokens=4)
    bomb = RequestResult("bomb", False, 0.0, e2e=2.1, error="HTTP 400: timed out")
    report = summarize([ok, bomb], 10.0, [], 0.0)
    assert report["requests"] == 1 and report["errors"] == 0 and report["completed"] == 1
    assert report["bombs"] == 1 and report["bombs_failed"] == 1
    assert report["bomb_fail_s_max"] == pytest.approx(2.1)
    assert report["itl_p50_ms"] == pytest.approx(200.0)


def test_rss_growth_per_process_and_second_half() -> None:
    mb = 2**20
    # http flat at 100 MB; the core grows 10 MB/min linearly after a 60 s warm-up
    rss = [(float(t), {"http": 100 * mb, "engine_core": int((500 + t / 6) * mb)}) for t in range(0, 601, 10)]
    report = summarize_rss(rss, warmup_s=60.0)
    assert report["rss_http_growth_after_warmup_mb"] == 0.0
    assert report["rss_engine_core_after_warmup_mb"] == pytest.approx(510.0)
    assert report["rss_engine_core_growth_after_warmup_mb"] == pytest.approx(90.0)
    assert report["rss_engine_core_growth_after_warmup_pct"] == pytest.approx(100 * 90 / 510)
    assert report["rss_engine_core_growth_second_half_mb"] == pytest.approx(45.0)
    assert report["rss_engine_core_growth_mb_per_min"] == pytest.approx(10.0)


def test_tool_share_requests_carry_a_tool_set_of_their_own() -> None:
    from tandem.bench.tools import load_functions

    functions = load_functions()
    work = make_workload(["q"], [], 60, 0.0, 0.0, 32, None, seed=0, tool_share=0.5, functions=functions, tool_choice="named")
    tools = [r for r in work if r.kind == "tool"]
    assert 15 < len(tools) < 45 and all(r.tag >= 0 for r in tools)
    sets = {tuple(t["function"]["name"] for t in r.body["tools"]) for r in tools}
    assert len(sets) == len(tools)  # distinct per request
    for r in tools:
        named = r.body["tool_choice"]["function"]["name"]
        assert named in {t["function"]["name"] for t in r.body["tools"]} and r.body["parallel_tool_calls"] is False
