"""`tandem bench serve --soak`: every request distinct, the report at the mark and at the end, pool growth told from
the rest, the plot written; end to end on the demo model with a small pool."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest

from tandem.bench.load import RequestResult
from tandem.bench.serve import add_arguments, free_port, launch_server
from tandem.bench.soak import SoakSample, plot_soak, run_soak, soak_workload, summarize_soak
from tandem.bench.tools import load_functions


def test_every_soak_request_is_distinct() -> None:
    work = soak_workload(300, load_functions(), 16, None, seed=0)
    bodies = {json.dumps(r.body, sort_keys=True) for r in work}
    prompts = {r.body["messages"][0]["content"] for r in work}
    schemas = {json.dumps(r.body["response_format"]["json_schema"]["schema"], sort_keys=True) for r in work if r.kind == "json"}
    tools = {json.dumps(r.body["tools"], sort_keys=True) for r in work if r.kind == "tool"}
    assert len(bodies) == len(prompts) == 300 and [r.kind for r in work[:3]] == ["json", "json", "tool"]
    assert len(schemas) == 200 and len(tools) == 100


def test_bad_soak_sizes_are_refused() -> None:
    from tandem.bench.serve import run_bench_serve

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, msg in ((["--soak", "0"], "--soak must be"), (["--soak", "10", "--soak-mark", "11"], "--soak-mark must be")):
        with pytest.raises(SystemExit, match=msg):
            run_bench_serve(p.parse_args(argv))


def _sample(t: float, done: int, total_mb: int, resident_mb: int) -> SoakSample:
    mb = 2**20
    return SoakSample(t, done, {"total": total_mb * mb, "engine_core": (total_mb - 300) * mb, "http": 300 * mb},
                      {"reserved": 1024 * mb, "touched": resident_mb * mb, "resident": resident_mb * mb})


def test_summary_tells_the_pool_from_the_rest(tmp_path: Path) -> None:
    """RSS +200 MB after the mark, all of it the pool's resident bytes: the rest is flat; latency early vs late."""
    results = [RequestResult("json", True, float(i), i, ttft=0.1, e2e=1.0 + (i >= 90)) for i in range(100)]
    results.append(RequestResult("tool", False, 100.0, 100, error="HTTP 500: boom"))
    samples = [_sample(0, 0, 1000, 0), _sample(10, 20, 1500, 400), _sample(20, 60, 1600, 500), _sample(30, 101, 1700, 600)]
    report = summarize_soak(results, samples, mark=20)
    assert report["errors"] == 1 and report["error_samples"] == ["HTTP 500: boom"]
    assert report["rss_total_at_mark_mb"] == 1500 and report["rss_end_over_mark"] == pytest.approx(1700 / 1500)
    assert report["rss_growth_after_mark_mb"] == report["kv_resident_growth_after_mark_mb"] == 200
    assert report["rest_end_over_mark"] == 1.0
    assert report["p50_e2e_early_ms"] == 1000 and report["p50_e2e_late_ms"] == 2000
    plot_soak(samples, tmp_path / "soak.png", "test")
    assert (tmp_path / "soak.png").stat().st_size > 10_000


@pytest.mark.demo
def test_soak_against_the_demo_server(tmp_path: Path) -> None:
    """A short soak through a real `tandem serve` with a 128 MiB pool: every request answered, each server process
    and the pool sampled: its reservation as planned, blocks touched, its resident bytes inside the engine core's RSS."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--soak", "24", "--concurrency", "4", "--max-tokens", "8", "--rss-interval", "0.2",
                         "--serve-arg=--kv-cache-memory=128MiB", "--soak-plot", str(tmp_path / "soak.png")])
    proc = launch_server(None, ["--kv-cache-memory=128MiB", "--log-level=warning"], port := free_port(), 420)
    try:
        report = asyncio.run(run_soak(args, f"http://127.0.0.1:{port}", proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    assert report["errors"] == 0 and report["completed"] == 24 and report["samples"] >= 2, report["error_samples"]
    assert report["rss_engine_core_end_mb"] > 0 and report["rss_http_end_mb"] > 0
    assert report["kv_reserved_end_mb"] == pytest.approx(128, abs=1) and report["kv_touched_end_mb"] > 0
    assert 0 < report["kv_resident_end_mb"] < report["rss_engine_core_end_mb"]
    assert os.path.getsize(tmp_path / "soak.png") > 10_000
