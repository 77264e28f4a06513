"""The load generator's client side, shared by `tandem bench serve` and its soak: one request of a workload, its
streamed result timed delta by delta, a process's resident memory from /proc, percentiles."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # the openai client's HTTP library; plain httpx exposes the same API
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]


@dataclass(frozen=True)
class BenchRequest:
    kind: str  # "plain" | "json" | "copy" | "tool" | "bomb"
    body: dict[str, Any]
    tag: int = -1  # the request's index in its workload (tool comparisons pair requests by it)


@dataclass
class RequestResult:
    kind: str
    ok: bool
    start: float
    tag: int = -1
    ttft: float | None = None
    e2e: float | None = None  # seconds to the end of the request (its failure included)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def send_one(client: httpx.AsyncClient, url: str, req: BenchRequest, headers: dict[str, str]) -> RequestResult:
    """Stream one chat completion; times every content delta and the end of the request."""
    res = await _stream_one(client, url, req, headers)
    res.e2e = time.perf_counter() - res.start
    return res


async def _stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest, headers: dict[str, str]) -> RequestResult:
    t0 = time.perf_counter()
    res = RequestResult(req.kind, False, t0, req.tag)
    last: float | None = None
    try:
        async with client.stream("POST", url, json=req.body, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    res.output_tokens = int(event["usage"].get("completion_tokens", 0))
                deltas = [c.get("delta") or {} for c in event.get("choices", [])]
                if any(d.get("content") or d.get("tool_calls") for d in deltas):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    elif last is not None:
                        res.itl.append(now - last)
                    last = now
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def process_rss_bytes(pid: int) -> int | None:
    """VmRSS of one process (Linux /proc), or None when it is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


async def engine_core_pid(client: httpx.AsyncClient, base_url: str) -> int | None:
    """The engine-core process id the server's /health reports (None if it does not answer)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        return int((await client.get(f"{base_url}/health")).json()["engine_core_pid"])
    return None


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out
