"""Shared benchmark plumbing: prompt sets, a concurrency-limited engine driver, percentiles, tables."""

from __future__ import annotations

import gzip
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.engine import LLMEngine
from tandem.params import ParamError, SamplingParams

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def shared_data_dir() -> Path:
    """../shared/data beside the repository (or $TANDEM_SHARED_DATA, read at call time)."""
    env = os.environ.get("TANDEM_SHARED_DATA")
    return Path(env) if env else SHARED_DATA.resolve()


def load_prompts(kind: str, limit: int) -> list[str]:
    """Prompts from ../shared/data/prompts: 'mt_bench', 'humaneval', 'gsm8k', or 'mixed' (round-robin of the three)."""
    root = shared_data_dir() / "prompts"
    if kind == "mixed":
        sets = [load_prompts(k, limit) for k in ("mt_bench", "humaneval", "gsm8k")]
        out = [p for trio in zip(*sets) for p in trio]
        return out[:limit]
    if kind == "mt_bench":
        rows = [json.loads(line) for line in (root / "mt_bench_question.jsonl").read_text().splitlines() if line.strip()]
        return [r["turns"][0] for r in rows][:limit]
    if kind == "humaneval":
        with gzip.open(root / "HumanEval.jsonl.gz", "rt") as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()][:limit]
    if kind == "gsm8k":
        rows = [json.loads(line) for line in (root / "gsm8k_test.jsonl").read_text().splitlines()[: limit * 2] if line.strip()]
        return [r["question"] for r in rows][:limit]
    raise ValueError(f"unknown prompt set {kind!r}; known: mt_bench, humaneval, gsm8k, mixed")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_line() -> str:
    """The CPU model, its deciding ISA flags, the cores used and the kernel path of each weight format: figures
    differ between an AMD EPYC and an Intel Xeon with AMX, and tables must say which measured them."""
    from tandem.cpu_features import cpu_features
    from tandem.layers.linear import kernel_paths

    cpu = cpu_features()
    paths = ", ".join(f"{fmt} {path}" for fmt, path in kernel_paths().items())
    cpus = len(os.sched_getaffinity(0))
    return f"{cpu.model} ({cpu.isa_summary()}), {cpus} cores; kernels: {paths}; Python {platform.python_version()}"


@dataclass
class RunResult:
    """Figures of one workload through one engine."""

    name: str
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # reasons of requests the engine refused at add_request

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests": self.num_requests,
            "out_tokens": self.output_tokens,
            "tok/s": round(self.tok_per_s, 1),
            "ttft_p50_ms": round(percentile(self.ttft_s, 50) * 1e3, 1),
            "tpot_p50_ms": round(percentile(self.tpot_s, 50) * 1e3, 1),
            **({"refused": len(self.refused)} if self.refused else {}),
            **self.extra,
        }


def drive(
    engine: LLMEngine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    concurrency: int,
    name: str,
    on_output: Callable[[Any], None] | None = None,
) -> RunResult:
    """Run `prompts` keeping at most `concurrency` in flight; time to first token and per output token per request."""
    plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
    pending = list(range(len(prompts)))[::-1]
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    res = RunResult(name, len(prompts), 0, 0.0)
    t0 = time.perf_counter()

    def top_up() -> None:
        while pending and engine.num_unfinished_requests < concurrency:
            i = pending.pop()
            rid = f"{name}-{i}"
            start[rid] = time.perf_counter()
            try:
                engine.add_request(rid, prompts[i], plist[i])
            except ParamError as e:  # refused (a 4xx in the server): counted, not run
                res.refused.append(str(e))

    top_up()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            ntok = sum(len(o.token_ids) for o in out.outputs)
            if rid not in first and ntok:  # a FINAL_ONLY request reports once: its metrics know its first token
                at = out.metrics.first_token_time if out.metrics is not None else None
                since = 0.0 if at is None else time.monotonic() - at
                first[rid] = now - max(0.0, since)
            if out.finished:
                res.output_tokens += ntok
                ttft = first.get(rid, now) - start[rid]
                res.ttft_s.append(ttft)
                if ntok > 1:
                    res.tpot_s.append((now - first.get(rid, now)) / (ntok - 1))
                if on_output is not None:
                    on_output(out)
        top_up()
    res.wall_s = time.perf_counter() - t0
    if res.refused:  # a figure over fewer requests than asked: said, never only counted
        print(f"{name}: {len(res.refused)} of {len(prompts)} requests refused, e.g. {res.refused[0]}", file=sys.stderr)
    return res


def print_table(rows: list[dict[str, Any]], title: str = "") -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |")
    lines.append("|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|")
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def summarize_stats(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g}"
