"""`tandem bench serve --soak N`: a server's memory over N distinct structured requests, pool growth told from the rest.

Every request is one a cache cannot answer: a JSON-schema answer over its own schema (`distinct_schemas`), or a tool
call over its own tool set, each with its own prompt (the request's number in it, so no two prompts share more than
the chat template's prefix). A closed loop of `--concurrency` clients sends them; once a second the sampler reads the
resident memory of every process of the server (the HTTP process, the engine core, any worker below them) from /proc
and the KV pool's figures from /metrics (`tandem_kv_pool_*`), with the number of requests completed so far.

The report gives RSS and the pool's resident bytes at request `--soak-mark` (default N / 5) and at N, their ratio,
and the growth of everything but the pool (RSS minus the pool's resident bytes): a pool filling its reservation
shows as KV growth, a leak as growth of the rest. p50 latency over the requests completed in (N/10, N/5] against the
last tenth tells whether the server slowed down. `--soak-plot PATH` draws both series against requests completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.load import (
    BenchRequest,
    RequestResult,
    engine_core_pid,
    httpx,
    percentile,
    process_rss_bytes,
    process_tree,
    send_one,
)
from tandem.bench.schemas import describe, distinct_schemas
from tandem.bench.tools import load_functions, tool_set

KV_METRICS = {"tandem_kv_pool_reserved_bytes": "reserved", "tandem_kv_pool_touched_bytes": "touched",
              "tandem_kv_pool_used_bytes": "used", "tandem_kv_pool_retained_bytes": "retained",
              "tandem_kv_pool_resident_bytes": "resident"}
TOOL_EVERY = 3  # every third request is a tool call, the others JSON-schema answers


@dataclass(frozen=True)
class SoakSample:
    """One reading: seconds since the start, requests completed, RSS per process label, KV pool bytes by figure."""

    t: float
    completed: int
    rss: dict[str, int]
    kv: dict[str, int]

    @property
    def rest(self) -> int:
        """Every byte of the server's RSS but the KV pool's resident ones."""
        return self.rss.get("total", 0) - self.kv.get("resident", 0)


def soak_workload(n: int, functions: Sequence[dict[str, Any]], max_tokens: int, model: str | None, seed: int) -> list[BenchRequest]:
    """`n` streaming chat requests, pairwise different: a distinct tool set every TOOL_EVERY-th, else a distinct
    JSON schema; every prompt carries its request number."""
    schemas = distinct_schemas(n - n // TOOL_EVERY, seed=seed)
    base: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                            **({"model": model} if model else {})}
    out: list[BenchRequest] = []
    for i in range(n):
        if functions and i % TOOL_EVERY == TOOL_EVERY - 1:
            entry = functions[i % len(functions)]
            body = {**base, "messages": [{"role": "user", "content": f"{entry['prompt']} (request {i})"}],
                    "tools": tool_set(functions, i % len(functions), seed=seed + i), "tool_choice": "required",
                    "parallel_tool_calls": False}
            out.append(BenchRequest("tool", body, i))
            continue
        schema = schemas[(i - i // TOOL_EVERY) % len(schemas)]
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
        body = {**base, "messages": [{"role": "user", "content": f"{describe(schema)} (request {i})"}], "response_format": fmt}
        out.append(BenchRequest("json", body, i))
    return out


# ------------------------------------------------------------------------------------------------------ sampling
def tree_rss(http_pid: int, core_pid: int | None) -> dict[str, int]:
    """RSS by process: "http", "engine_core", "others" (workers, helpers), and their "total"."""
    rss = {"http": 0, "engine_core": 0, "others": 0}
    for p in process_tree(http_pid):
        value = process_rss_bytes(p) or 0
        rss["http" if p == http_pid else "engine_core" if p == core_pid else "others"] += value
    rss["total"] = sum(rss.values())
    return rss


async def kv_figures(client: httpx.AsyncClient, base_url: str) -> dict[str, int]:
    """The KV pool's bytes from the server's /metrics (empty when it does not answer)."""
    out: dict[str, int] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in (await client.get(f"{base_url}/metrics")).text.splitlines():
            name, _, value = line.partition(" ")
            if name in KV_METRICS:
                with contextlib.suppress(ValueError):
                    out[KV_METRICS[name]] = int(float(value))
    return out


async def sample_soak(client: httpx.AsyncClient, base_url: str, pid: int, interval: float, results: list[RequestResult],
                      samples: list[SoakSample], stop: asyncio.Event) -> None:
    """A SoakSample every `interval` s until `stop` is set, and one more after it."""
    t0 = time.perf_counter()
    core = await engine_core_pid(client, base_url)
    while True:
        samples.append(SoakSample(time.perf_counter() - t0, len(results), tree_rss(pid, core), await kv_figures(client, base_url)))
        if stop.is_set():
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


# ------------------------------------------------------------------------------------------------------- report
def at_request(samples: Sequence[SoakSample], n: int) -> SoakSample:
    """The first sample taken once `n` requests had completed (the last one if none was)."""
    return next((s for s in samples if s.completed >= n), samples[-1])


def summarize_soak(results: Sequence[RequestResult], samples: Sequence[SoakSample], mark: int) -> dict[str, Any]:
    """Errors, RSS and KV at `mark` and at the end (MB) with their ratios, and p50 latency early against late."""
    mb = 2**20
    done = sorted((r for r in results if r.ok and r.e2e is not None), key=lambda r: r.start + (r.e2e or 0.0))
    n = len(results)
    early = [r.e2e for r in done[n // 10 : n // 5] if r.e2e is not None]
    late = [r.e2e for r in done[n - n // 10 :] if r.e2e is not None]
    a, b = at_request(samples, mark), samples[-1]
    p50_early, p50_late = percentile(early, 50), percentile(late, 50)
    report: dict[str, Any] = {
        "requests": n, "completed": len(done), "errors": n - len(done),
        "error_samples": sorted({r.error or "" for r in results if not r.ok})[:5],
        "by_kind": {k: sum(1 for r in done if r.kind == k) for k in sorted({r.kind for r in results})},
        "mark": mark, "samples": len(samples),
        "p50_e2e_early_ms": None if p50_early is None else 1e3 * p50_early,
        "p50_e2e_late_ms": None if p50_late is None else 1e3 * p50_late,
        "p50_late_over_early": p50_late / p50_early if p50_early and p50_late else None,
    }
    for label in ("total", "engine_core", "http", "others"):
        report[f"rss_{label}_at_mark_mb"] = a.rss.get(label, 0) / mb
        report[f"rss_{label}_end_mb"] = b.rss.get(label, 0) / mb
    report["rss_end_over_mark"] = b.rss["total"] / a.rss["total"] if a.rss.get("total") else None
    for figure in ("reserved", "touched", "resident", "retained"):
        report[f"kv_{figure}_at_mark_mb"] = a.kv.get(figure, 0) / mb
        report[f"kv_{figure}_end_mb"] = b.kv.get(figure, 0) / mb
    report["rest_at_mark_mb"], report["rest_end_mb"] = a.rest / mb, b.rest / mb
    report["rest_end_over_mark"] = b.rest / a.rest if a.rest > 0 else None
    report["rss_growth_after_mark_mb"] = (b.rss["total"] - a.rss["total"]) / mb
    report["kv_resident_growth_after_mark_mb"] = (b.kv.get("resident", 0) - a.kv.get("resident", 0)) / mb
    return report


def plot_soak(samples: Sequence[SoakSample], path: Path, title: str) -> None:
    """RSS per process and the KV pool's figures (MB) against requests completed; below, RSS minus the pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.completed for s in samples]
    mb = 2**20
    fig, (top, low) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for label, style in (("total", "-"), ("engine_core", "-"), ("http", "-")):
        top.plot(x, [s.rss.get(label, 0) / mb for s in samples], style, label=f"RSS {label.replace('_', ' ')}")
    for figure, style in (("resident", "--"), ("touched", ":"), ("reserved", "-.")):
        top.plot(x, [s.kv.get(figure, 0) / mb for s in samples], style, label=f"KV pool {figure}")
    top.set_ylabel("MB")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    low.plot(x, [s.rest / mb for s in samples], color="k", label="RSS total minus KV pool resident")
    low.set_xlabel("requests completed")
    low.set_ylabel("MB")
    low.legend(loc="lower right", fontsize=8)
    low.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- running
async def run_soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict[str, Any]:
    """The soak: `args.soak` distinct structured requests from `args.concurrency` (default 16) clients."""
    if pid is None:
        raise SystemExit("--soak reads every server process from /proc: pass --launch or --server-pid")
    functions = load_functions(Path(args.tools_dir))
    workload = soak_workload(args.soak, functions, args.max_tokens, args.model, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{base_url}/v1/chat/completions"
    results: list[RequestResult] = []
    samples: list[SoakSample] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=max(args.concurrency or 16, 64), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        sampler = asyncio.create_task(sample_soak(client, base_url, pid, args.rss_interval, results, samples, stop))
        it = iter(workload)

        async def worker() -> None:
            for req in it:
                results.append(await send_one(client, url, req, headers))

        await asyncio.gather(*(worker() for _ in range(args.concurrency or 16)))
        stop.set()
        await sampler
    report = summarize_soak(results, samples, args.soak_mark or max(1, args.soak // 5))
    if args.soak_plot:
        serve_args = " ".join(args.serve_arg) or "defaults"
        plot_soak(samples, Path(args.soak_plot), f"tandem serve ({serve_args}): {args.soak} distinct structured requests")
        report["plot"] = args.soak_plot
    return report
