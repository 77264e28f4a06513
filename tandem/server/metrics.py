"""Prometheus metrics of the server: request counts, token counts, latencies, and the engine's own stats.

HTTP-side metrics (counters and histograms) are measured in the HTTP process when deltas arrive. Engine gauges come
from the last `get_stats()` snapshot the engine core sent: known keys get stable names (running / waiting requests,
KV cache use, prefix cache), and every other numeric key (grammar compile time, cache hits, speculative acceptance,
whatever the engine reports) is exported as `tandem_engine_<key>`. Each server owns its own registry.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# engine stats key -> (metric name, help); the rest are exported generically
_KNOWN_STATS: dict[str, tuple[str, str]] = {
    "num_running": ("tandem_num_requests_running", "Sequences running in the engine"),
    "num_waiting": ("tandem_num_requests_waiting", "Sequences waiting in the engine's queue"),
    "kv_cache_usage": ("tandem_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests"),
    "kv_num_blocks": ("tandem_kv_cache_num_blocks", "KV cache size in blocks"),
    "kv_pool_reserved_bytes": ("tandem_kv_pool_reserved_bytes", "KV pool planned at start (bytes; host pages committed on first use)"),
    "kv_pool_touched_bytes": ("tandem_kv_pool_touched_bytes", "KV pool blocks ever used (bytes): what the pool can hold resident"),
    "kv_pool_used_bytes": ("tandem_kv_pool_used_bytes", "KV pool blocks held by requests now (bytes)"),
    "kv_pool_retained_bytes": ("tandem_kv_pool_retained_bytes", "KV pool blocks kept by the prefix cache alone (bytes)"),
    "kv_pool_resident_bytes": ("tandem_kv_pool_resident_bytes", "KV pool memory resident now (bytes, measured)"),
    "prefix_cache_retained_blocks": ("tandem_prefix_cache_retained_blocks", "Cached blocks no request holds (evictable)"),
    "prefix_cache_queries": ("tandem_prefix_cache_queries", "Prompt blocks looked up in the prefix cache (cumulative)"),
    "prefix_cache_hits": ("tandem_prefix_cache_hits", "Prompt blocks found in the prefix cache (cumulative)"),
    "steps_scheduled_ahead": ("tandem_steps_scheduled_ahead", "Steps scheduled while the previous forward ran (cumulative)"),
    "steps_launched_before_settle": ("tandem_steps_launched_before_settle",
                                     "Steps with drafts whose next plan was launched before its rows took their outcome "
                                     "(cumulative)"),
    "num_ended_rows_withdrawn": ("tandem_ended_rows_withdrawn",
                                 "Rows of requests a step's tokens ended, left out of the next plan scheduled ahead "
                                 "instead of computed and thrown away (cumulative)"),
    "spec_optimistic_misses": ("tandem_spec_optimistic_misses",
                               "Drafts made past a forward's outcome that it did not match (cumulative)"),
    "device_idle_ms_per_step": ("tandem_device_idle_ms_per_step",
                                "Mean time from a forward's end to the next launch (ms)"),
}


_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})


def _metric_suffix(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


class EngineStatsCollector(Collector):
    """Gauges from the latest engine stats snapshot (`stats()`), plus liveness and the core's RSS."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        alive: Callable[[], bool],
        core_pid: Callable[[], int | None],
        restarts: Callable[[], int] = lambda: 0,
    ) -> None:
        self._stats = stats
        self._alive = alive
        self._core_pid = core_pid
        self._restarts = restarts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        alive = GaugeMetricFamily("tandem_engine_core_alive", "1 while the engine-core process runs")
        alive.add_metric([], 1.0 if self._alive() else 0.0)
        yield alive
        restarts = CounterMetricFamily("tandem_engine_core_restarts", "Engine cores started after one died")
        restarts.add_metric([], float(self._restarts()))
        yield restarts
        rss = core_rss_bytes(self._core_pid())
        if rss is not None:
            g = GaugeMetricFamily("tandem_engine_core_resident_memory_bytes", "Resident memory of the engine-core process")
            g.add_metric([], float(rss))
            yield g
        yield from spec_decode_metrics(stats)
        for key, value in _flatten(stats):
            name, doc = _KNOWN_STATS.get(key, (f"tandem_engine_{_metric_suffix(key)}", f"engine stat {key!r}"))
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


# engine stats key -> (vLLM's speculative-decoding counter, help): the names vLLM's dashboards read
_SPEC_COUNTERS = {
    "spec_num_drafts": ("vllm:spec_decode_num_drafts", "Request-steps that verified drafts"),
    "spec_num_drafted": ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_num_accepted": ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
}


def spec_decode_metrics(stats: Mapping[str, Any]) -> Iterator[CounterMetricFamily]:
    """vLLM's speculative-decoding counters (present when speculation is configured), per-position included."""
    for key, (name, doc) in _SPEC_COUNTERS.items():
        if key in stats:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(stats[key]))
            yield c
    per_pos = stats.get("spec_accepted_per_position")
    if isinstance(per_pos, list):
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position",
                                labels=["position"])
        for i, n in enumerate(per_pos):
            c.add_metric([str(i)], float(n))
        yield c


def _flatten(stats: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of a (possibly nested) stats dict, keys joined with '_'."""
    for k, v in stats.items():
        key = f"{prefix}{k}"
        if isinstance(v, (bool, int, float)):
            yield key, float(v)
        elif isinstance(v, Mapping):
            yield from _flatten(v, f"{key}_")


KV_POOL_KEYS = ("kv_pool_reserved_bytes", "kv_pool_touched_bytes", "kv_pool_used_bytes", "kv_pool_retained_bytes",
                "kv_pool_resident_bytes", "prefix_cache_retained_blocks")


def memory_detail(stats: Mapping[str, Any], core_pids: list[int]) -> dict[str, Any]:
    """/health's memory detail: the KV pool's figures from the latest engine stats (summed over replicas) and the
    resident memory of the HTTP process and of each engine core, in bytes."""
    pool = {key.removeprefix("kv_pool_"): int(stats[key]) for key in KV_POOL_KEYS if key in stats}
    cores = {str(pid): core_rss_bytes(pid) for pid in core_pids}
    return {"kv_pool": pool, "rss_bytes": {"http": core_rss_bytes(os.getpid()), "engine_cores": cores}}


def core_rss_bytes(pid: int | None) -> int | None:
    """VmRSS of a process from /proc (Linux), or None when unavailable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class ServerMetrics:
    """The registry and the HTTP-side metrics of one server."""

    def __init__(self, engine_stats: EngineStatsCollector | None = None) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. of the HTTP process
        r = self.registry
        self.requests = Counter("tandem_requests", "Finished HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.finish_reasons = Counter("tandem_request_finish", "Completions by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens", registry=r)
        self.cached_prompt_tokens = Counter("tandem_prompt_tokens_cached", "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between token deltas of one completion", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Request latency, receipt to last token", buckets=_E2E_BUCKETS, registry=r)
        self.rejected = Counter("tandem_requests_rejected", "Requests refused before reaching the engine", ["reason"], registry=r)
        if engine_stats is not None:
            r.register(engine_stats)

    def count_response(self, path: str, status: int) -> None:
        """Count one answered /v1/* request by endpoint and HTTP status."""
        if path.startswith("/v1/"):
            endpoint = path if path in _ENDPOINTS else "other"  # bounded label values, whatever clients send
            self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
