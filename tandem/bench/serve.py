"""`tandem bench serve`: an asyncio load generator for an OpenAI-compatible server (streaming chat completions).

Workload: MT-Bench questions and HumanEval prompts from ../shared/data/prompts; a `--json-share` of requests asks
for a JSON-schema answer (response_format json_schema), a `--copy-share` asks to copy / lightly edit a given code
prompt (speculative-friendly: the answer repeats the input). Arrivals are Poisson at `--request-rate` (inf: all at
once) or a closed loop of `--concurrency` workers. Reports req/s, output tok/s, TTFT / TPOT / ITL p50 / p99 and
errors. `--duration` runs a soak instead of a fixed request count and samples the server's RSS per process (the HTTP
process `--server-pid` and its engine core from /proc, else the /metrics resident-memory gauges of both) to report
growth after the warm-up. `--bomb-every N` makes every Nth request a "compile bomb": a JSON schema (unique per request,
so neither the grammar cache nor compile coalescing can answer it) that takes a grammar backend far longer than the
server's compile timeout; bombs are reported apart (they are expected to fail), every other figure covers the rest.
`--launch` starts `tandem serve` itself on a free loopback port. `--soak N` runs the memory soak of
`tandem/bench/soak.py` instead (N distinct structured requests; RSS per process and the KV pool's figures).

`--tool-share` makes a fraction of requests tool calls (`--tool-choice` required / auto / named) over a distinct tool
set per request: three functions drawn from the function corpus (`--tools-dir`, tests/data/functions). `--tool-compare`
measures the tool-calling cost at equal lengths: it runs N tool-call requests (tool_choice required), then the same
N requests answered as text (same messages and tools, tool_choice "none") with min_tokens = max_tokens = the number
of tokens each tool answer took, and reports both output-token throughputs and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
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
from tandem.bench.schemas import distinct_schemas
from tandem.bench.soak import run_soak
from tandem.bench.tools import DEFAULT_TOOLS, load_functions, tool_set

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "../shared/data/prompts"

JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["title", "rating", "keywords"],
    "additionalProperties": False,
}


def bomb_schema(nonce: int, repeat: int = 8) -> dict[str, Any]:
    """A small JSON schema (~150 bytes) whose grammar takes xgrammar far longer than any sane compile timeout.

    Its string pattern nests three counted repetitions, ((([a-z]{1,r}){1,r}){1,r}): the regex-to-grammar conversion
    unrolls each count, so the grammar has ~r^3 rules, every one needing a token mask over the whole vocabulary.
    `nonce` makes each schema unique, so neither the grammar cache nor compile coalescing can answer a bomb.
    """
    pattern = f"^((([a-z]{{1,{repeat}}}){{1,{repeat}}}){{1,{repeat}}})$"
    return {"type": "object", "properties": {"id": {"type": "string", "pattern": pattern}}, "required": ["id"],
            "additionalProperties": False, "description": f"bomb {nonce}"}


# ------------------------------------------------------------------------------------------------------ workload
def tool_body(functions: Sequence[dict[str, Any]], i: int, seed: int, choice: str, base: dict[str, Any]) -> dict[str, Any]:
    """A tool-call request: entry i's prompt over its function and two others (a distinct tool set per request)."""
    n = len(functions)
    entry = functions[i % n]
    tool_choice: Any = choice
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": entry["function"]["name"]}}
    return {**base, "messages": [{"role": "user", "content": entry["prompt"]}], "tools": tool_set(functions, i % n, seed=seed + i // n),
            "tool_choice": tool_choice, "parallel_tool_calls": False}


def load_prompts(data_dir: Path) -> tuple[list[str], list[str]]:
    """(MT-Bench first turns, HumanEval prompts); either list may be empty when its file is missing."""
    questions: list[str] = []
    mt = data_dir / "mt_bench_question.jsonl"
    if mt.is_file():
        questions = [json.loads(line)["turns"][0] for line in mt.read_text().splitlines() if line.strip()]
    code: list[str] = []
    he = data_dir / "HumanEval.jsonl.gz"
    if he.is_file():
        with gzip.open(he, "rt") as f:
            code = [json.loads(line)["prompt"] for line in f if line.strip()]
    return questions, code


def make_workload(
    questions: Sequence[str], code: Sequence[str], count: int, json_share: float, copy_share: float,
    max_tokens: int, model: str | None, seed: int, bomb_every: int = 0,
    tool_share: float = 0.0, functions: Sequence[dict[str, Any]] = (), tool_choice: str = "required",
    schemas: Sequence[dict[str, Any]] = (),
) -> list[BenchRequest]:
    """`count` chat requests: a json_share of JSON-schema ones, a copy_share of copy/edit ones, a tool_share of tool
    calls, the rest plain; with `bomb_every` N > 0, requests N-1, 2N-1, ... are replaced by compile bombs. JSON
    requests use `schemas` in turn (request i the i-th, modulo) when given, else one shared summary schema."""
    if tool_share > 0 and not functions:
        raise SystemExit("no function definitions found: pass --tools-dir (tests/data/functions)")
    if not questions and not code:
        raise SystemExit("no prompts found: pass --data-dir (../shared/data/prompts)")
    rng = random.Random(seed)
    plain_pool = list(questions) + [f"Explain what this function should do:\n{c}" for c in code]
    copy_pool = list(code) or list(questions)
    out = []
    for i in range(count):
        u = rng.random()
        base: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if model:
            base["model"] = model
        if bomb_every > 0 and (i + 1) % bomb_every == 0:
            msg = "Give me a record with an id as JSON."
            fmt = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": bomb_schema(i), "strict": True}}
            out.append(BenchRequest("bomb", {**base, "messages": [{"role": "user", "content": msg}], "response_format": fmt}))
            continue
        if u >= 1.0 - tool_share:
            out.append(BenchRequest("tool", tool_body(functions, i, seed, tool_choice, base), i))
        elif u < json_share:
            q = rng.choice(plain_pool)
            msg = f"Summarize the following request as JSON with a title, a rating from 1 to 10 and keywords:\n{q}"
            schema = schemas[i % len(schemas)] if schemas else JSON_SCHEMA
            body = {**base, "messages": [{"role": "user", "content": msg}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "summary", "schema": schema, "strict": True}}}
            out.append(BenchRequest("json", body))
        elif u < json_share + copy_share:
            src = rng.choice(copy_pool)
            msg = f"Repeat the following code exactly, but rename every variable `numbers` to `values`:\n\n{src}"
            out.append(BenchRequest("copy", {**base, "messages": [{"role": "user", "content": msg}], "temperature": 0.0}))
        else:
            out.append(BenchRequest("plain", {**base, "messages": [{"role": "user", "content": rng.choice(plain_pool)}]}))
    return out


# ------------------------------------------------------------------------------------------------------ RSS sampling
RssSample = tuple[float, dict[str, int]]  # (seconds since start, {"http" | "engine_core" | "total": bytes})


def tree_rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` plus its descendants (Linux /proc), or None when `pid` is gone."""
    if process_rss_bytes(pid) is None:
        return None
    return sum(process_rss_bytes(p) or 0 for p in process_tree(pid))


def proc_rss_sample(http_pid: int, core_pid: int | None) -> dict[str, int] | None:
    """{"http", "engine_core", "total"} from /proc; total is the whole process tree (helpers included)."""
    total = tree_rss_bytes(http_pid)
    if total is None:
        return None
    out = {"total": total}
    http = process_rss_bytes(http_pid)
    if http is not None:
        out["http"] = http
    core = process_rss_bytes(core_pid) if core_pid is not None else None
    if core is not None:
        out["engine_core"] = core
    return out


async def metrics_rss_sample(client: httpx.AsyncClient, base_url: str) -> dict[str, int] | None:
    """HTTP process and engine-core resident memory from the server's /metrics."""
    try:
        text = (await client.get(f"{base_url}/metrics")).text
    except httpx.HTTPError:
        return None
    names = {"process_resident_memory_bytes": "http", "tandem_engine_core_resident_memory_bytes": "engine_core"}
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            with contextlib.suppress(ValueError):
                out[names[name]] = int(float(value))
    if not out:
        return None
    out["total"] = sum(out.values())
    return out


async def sample_rss(client: httpx.AsyncClient, base_url: str, pid: int | None, interval: float,
                     samples: list[RssSample], stop: asyncio.Event) -> None:
    """Append one per-process RSS sample every `interval` s until `stop` is set."""
    t0 = time.perf_counter()
    core = await engine_core_pid(client, base_url) if pid is not None else None
    while not stop.is_set():
        rss = proc_rss_sample(pid, core) if pid is not None else await metrics_rss_sample(client, base_url)
        if rss is not None:
            samples.append((time.perf_counter() - t0, rss))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def summarize_rss(rss: Sequence[RssSample], warmup_s: float) -> dict[str, Any]:
    """Per process: start, after-warm-up, end and peak MB; growth after warm-up (MB, %, MB/min) and the growth in
    the second half of the post-warm-up window alone (near 0 when the RSS has plateaued, about half the total when
    it grows linearly, i.e. leaks)."""
    report: dict[str, Any] = {}
    labels = sorted({k for _, d in rss for k in d}, key=["http", "engine_core", "total"].index)
    for label in labels:
        series = [(t, d[label]) for t, d in rss if label in d]
        if not series:
            continue
        after = [(t, b) for t, b in series if t >= warmup_s] or [series[-1]]
        (t_w, b_w), (t_e, b_e) = after[0], series[-1]
        mid_t = (t_w + t_e) / 2.0
        b_mid = next((b for t, b in after if t >= mid_t), b_e)
        span_min = max((t_e - t_w) / 60.0, 1e-9)
        mb = 2**20
        report[f"rss_{label}_start_mb"] = series[0][1] / mb
        report[f"rss_{label}_after_warmup_mb"] = b_w / mb
        report[f"rss_{label}_end_mb"] = b_e / mb
        report[f"rss_{label}_peak_mb"] = max(b for _, b in series) / mb
        report[f"rss_{label}_growth_after_warmup_mb"] = (b_e - b_w) / mb
        report[f"rss_{label}_growth_after_warmup_pct"] = 100.0 * (b_e - b_w) / b_w if b_w else 0.0
        report[f"rss_{label}_growth_second_half_mb"] = (b_e - b_mid) / mb
        report[f"rss_{label}_growth_mb_per_min"] = (b_e - b_w) / mb / span_min
    return report


# ------------------------------------------------------------------------------------------------------- running
def summarize(results: Sequence[RequestResult], wall_s: float, rss: Sequence[RssSample], warmup_s: float) -> dict[str, Any]:
    """The report; compile bombs (kind "bomb") are counted apart and left out of every other figure."""
    bombs = [r for r in results if r.kind == "bomb"]
    results = [r for r in results if r.kind != "bomb"]
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.e2e and r.ttft is not None and r.output_tokens > 1]
    report: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error or "" for r in results if not r.ok})[:5],
        "by_kind": {k: sum(1 for r in ok if r.kind == k) for k in sorted({r.kind for r in results})},
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_token_throughput": out_tokens / wall_s if wall_s > 0 else 0.0,
        "output_tokens": out_tokens,
    }
    if bombs:
        fail_s = [r.e2e for r in bombs if not r.ok]
        report["bombs"] = len(bombs)
        report["bombs_failed"] = sum(1 for r in bombs if not r.ok)
        report["bomb_fail_s_p50"] = percentile([x for x in fail_s if x is not None], 50)
        report["bomb_fail_s_max"] = max((x for x in fail_s if x is not None), default=None)
        report["bomb_error_samples"] = sorted({(r.error or "")[:160] for r in bombs if not r.ok})[:3]
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", [r.e2e for r in ok if r.e2e is not None])):
        for q in (50, 99):
            v = percentile(vals, q)
            report[f"{name}_p{q}_ms"] = None if v is None else v * 1000.0
    report.update(summarize_rss(rss, warmup_s))
    return report


async def run_load(args: argparse.Namespace, base_url: str, server_pid: int | None,
                   workload: Sequence[BenchRequest] | None = None) -> dict[str, Any]:
    questions, code = load_prompts(Path(args.data_dir))
    count = args.num_requests if args.duration is None else max(args.num_requests, 100_000)
    functions = load_functions(Path(args.tools_dir)) if (args.tool_share > 0 or args.tool_compare) else []
    schemas = distinct_schemas(args.distinct_schemas, seed=args.seed) if args.distinct_schemas else ()
    if workload is None:
        workload = make_workload(questions, code, count, args.json_share, args.copy_share, args.max_tokens, args.model,
                                 args.seed, args.bomb_every, args.tool_share, functions, args.tool_choice, schemas)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 256), max_keepalive_connections=64)
    results: list[RequestResult] = []
    rss: list[RssSample] = []
    stop = asyncio.Event()
    deadline = None if args.duration is None else time.perf_counter() + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        sampler = asyncio.create_task(sample_rss(client, base_url, server_pid, args.rss_interval, rss, stop)) \
            if (args.duration is not None or server_pid is not None) else None
        killer = asyncio.create_task(kill_core_later(client, base_url, args.kill_core_after)) \
            if args.kill_core_after is not None else None
        t0 = time.perf_counter()
        if args.concurrency:
            await _closed_loop(client, url, workload, headers, args.concurrency, deadline, results)
        else:
            await _open_loop(client, url, workload, headers, args.request_rate, deadline, results, args.seed)
        wall = time.perf_counter() - t0
        stop.set()
        if sampler is not None:
            await sampler
        kill = await killer if killer is not None else None
    warmup = args.warmup if args.warmup is not None else (0.1 * args.duration if args.duration else 0.0)
    report = summarize(results, wall, rss, warmup)
    if kill is not None:
        report["core_kill"] = kill
    report["_tokens_by_tag"] = {r.tag: r.output_tokens for r in results if r.ok}
    return report


async def kill_core_later(client: httpx.AsyncClient, base_url: str, after_s: float) -> dict[str, Any]:
    """SIGKILL the server's engine core `after_s` seconds into the load (the server must run on this machine), then
    time how long until /health answers 200 from a new core."""
    await asyncio.sleep(after_s)
    pid = int((await client.get(f"{base_url}/health")).json()["engine_core_pid"])
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    while True:
        r = await client.get(f"{base_url}/health")
        if r.status_code == 200 and r.json().get("engine_core_pid") != pid:
            return {"killed_pid": pid, "at_s": after_s, "restart_s": round(time.perf_counter() - t0, 2),
                    "restarts": r.json().get("engine_restarts")}
        await asyncio.sleep(0.1)


async def run_tool_compare(args: argparse.Namespace, base_url: str, server_pid: int | None) -> dict[str, Any]:
    """Tool calls (required, distinct tool sets) vs the same requests answered as text at the same lengths."""
    functions = load_functions(Path(args.tools_dir))
    base: dict[str, Any] = {"max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0.0, **({"model": args.model} if args.model else {})}
    tools = [BenchRequest("tool", tool_body(functions, i, args.seed, "required", base), i) for i in range(args.num_requests)]
    tool_report = await run_load(args, base_url, server_pid, tools)
    lengths = tool_report.pop("_tokens_by_tag")
    text = [BenchRequest("text", {**r.body, "tool_choice": "none", "min_tokens": lengths[r.tag], "max_tokens": lengths[r.tag]}, r.tag)
            for r in tools if lengths.get(r.tag, 0) > 0]
    text_report = await run_load(args, base_url, server_pid, text)
    text_report.pop("_tokens_by_tag")
    ratio = tool_report["output_token_throughput"] / text_report["output_token_throughput"] if text_report["output_token_throughput"] else 0.0
    return {"tool_calls": tool_report, "text_same_lengths": text_report, "tool_vs_text_throughput": ratio,
            "completed": tool_report["completed"]}


async def _closed_loop(client: httpx.AsyncClient, url: str, workload: Sequence[BenchRequest], headers: dict[str, str],
                       concurrency: int, deadline: float | None, results: list[RequestResult]) -> None:
    it = iter(workload)

    async def worker() -> None:
        for req in it:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            results.append(await send_one(client, url, req, headers))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(client: httpx.AsyncClient, url: str, workload: Sequence[BenchRequest], headers: dict[str, str],
                     rate: float, deadline: float | None, results: list[RequestResult], seed: int) -> None:
    rng = random.Random(seed + 1)
    tasks: list[asyncio.Task[None]] = []

    async def one(req: BenchRequest) -> None:
        results.append(await send_one(client, url, req, headers))

    for req in workload:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
        tasks = [t for t in tasks if not t.done()] if len(tasks) > 1024 else tasks
    await asyncio.gather(*tasks)


# ------------------------------------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(
    model: str | None, serve_args: Sequence[str], port: int, startup_timeout_s: float,
    log: Any = None, env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `tandem serve` on 127.0.0.1:`port`; return once /health answers 200 (raise if it exits first).

    `log`: a file object for the server's stdout and stderr (default: inherited); `env`: its environment.
    """
    cmd = [sys.executable, "-m", "tandem.cli", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log is not None else None, env=env)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return proc
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not become ready within {startup_timeout_s:.0f} s")


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """`tandem bench serve ...`: the load generator."""
    p: argparse.ArgumentParser = bsub.add_parser(
        "serve", help="load-test an OpenAI-compatible server", description="Load generator for `tandem serve`."
    )
    add_arguments(p)
    p.set_defaults(func=run_bench_serve)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (ignored with --launch)")
    p.add_argument("--launch", action="store_true", help="start `tandem serve` on a free loopback port first")
    p.add_argument("--launch-model", default=None, help="model for --launch (default: the demo model)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for the launched server; repeatable")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--num-requests", type=int, default=100)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: all at once)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json-share", type=float, default=0.0, help="fraction of JSON-schema requests")
    p.add_argument("--kill-core-after", type=float, default=None, metavar="S",
                   help="SIGKILL the engine core S seconds into the load and report the time until it serves again")
    p.add_argument("--distinct-schemas", type=int, default=0, metavar="N",
                   help="JSON requests take N distinct schemas in turn (0: one shared schema)")
    p.add_argument("--copy-share", type=float, default=0.0, help="fraction of copy/edit (speculative-friendly) requests")
    p.add_argument("--tool-share", type=float, default=0.0, help="fraction of tool-call requests (distinct tool sets)")
    p.add_argument("--tool-choice", default="required", choices=["required", "auto", "named"])
    p.add_argument("--tool-compare", action="store_true",
                   help="tool calls vs the same requests answered as text at equal lengths (reports the ratio)")
    p.add_argument("--tools-dir", default=str(DEFAULT_TOOLS), help="function corpus (*.json of {prompt, function})")
    p.add_argument("--bomb-every", type=int, default=0, metavar="N",
                   help="make every Nth request a compile-bomb JSON schema (reported apart; 0: none)")
    p.add_argument("--duration", type=float, default=None, help="soak: run this many seconds and sample RSS")
    p.add_argument("--soak", type=int, default=None, metavar="N",
                   help="memory soak: N distinct structured requests (own schema or tool set, own prompt), RSS of every "
                        "server process and the KV pool's figures sampled (tandem/bench/soak.py)")
    p.add_argument("--soak-mark", type=int, default=None, metavar="M", help="soak: compare the end with request M (default N/5)")
    p.add_argument("--soak-plot", default=None, metavar="PNG", help="soak: plot RSS and the KV pool against requests")
    p.add_argument("--warmup", type=float, default=None, help="seconds before RSS growth is measured (default 10%% of --duration)")
    p.add_argument("--rss-interval", type=float, default=1.0)
    p.add_argument("--server-pid", type=int, default=None, help="read the server's RSS (with children) from /proc")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA))
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def _the_load(args: argparse.Namespace, base_url: str, pid: int | None) -> Any:
    if args.soak:
        return run_soak(args, base_url, pid)
    return run_tool_compare(args, base_url, pid) if args.tool_compare else run_load(args, base_url, pid)


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the load (launching the server first with --launch); print the report; exit 1 when every request failed."""
    if not 0.0 <= args.json_share + args.copy_share + args.tool_share <= 1.0:
        raise SystemExit("--json-share + --copy-share + --tool-share must be within [0, 1]")
    if args.soak is not None and args.soak < 1:
        raise SystemExit(f"--soak must be >= 1 requests, got {args.soak}")
    if args.soak_mark is not None and not (args.soak and 1 <= args.soak_mark <= args.soak):
        raise SystemExit(f"--soak-mark must be within [1, --soak], got {args.soak_mark}")
    if args.distinct_schemas < 0:
        raise SystemExit(f"--distinct-schemas must be >= 0 (0: one shared schema), got {args.distinct_schemas}")
    if args.kill_core_after is not None and args.kill_core_after < 0:
        raise SystemExit(f"--kill-core-after must be >= 0 seconds, got {args.kill_core_after}")
    if args.kill_core_after is not None and not args.launch:
        raise SystemExit("--kill-core-after needs --launch (it signals the engine core of a server on this machine)")
    proc = None
    base_url, pid = args.base_url.rstrip("/"), args.server_pid
    if args.launch:
        port = free_port()
        try:
            serve_args = list(args.serve_arg)
            if args.tool_compare and "--no-prefix-caching" not in serve_args:
                # the text run sends the tool run's prompts again: cached prefixes would skip its prefills
                serve_args.append("--no-prefix-caching")
            proc = launch_server(args.launch_model, serve_args, port, args.startup_timeout)
        except RuntimeError as e:
            raise SystemExit(str(e)) from e
        base_url, pid = f"http://127.0.0.1:{port}", pid or proc.pid
    try:
        report = asyncio.run(_the_load(args, base_url, pid))
        report.pop("_tokens_by_tag", None)
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
    for k, v in report.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for k2, v2 in v.items():
                print(f"  {k2:30s} {v2:.2f}" if isinstance(v2, float) else f"  {k2:30s} {v2}")
        else:
            print(f"{k:32s} {v:.2f}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0 if report["completed"] > 0 else 1
