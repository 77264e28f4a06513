"""Data parallel serving: N engine cores (each an `EngineClient`, restartable on its own) behind one API server.

`DataParallelClient` has the surface `api.py` uses of one `EngineClient`; each new request goes to the replica the
`Router` picks: the least loaded one (requests in flight there, plus its KV cache use from its last stats), unless the
request's prompt starts with a prefix one replica served recently and that replica is not much busier than the least
loaded one (its prefix cache then skips the shared blocks' prefill). While a replica restarts the others take
everything; the server is down only when every replica is. A request whose replica dies before its first delta is
sent again to another live replica (`RoutedStream`): nothing was delivered, so nothing is repeated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.layers.parallel import even_split
from tandem.params import SamplingParams
from tandem.server.engine_client import (
    CoreLauncher,
    EngineClient,
    EngineDeadError,
    LocalCoreLauncher,
    ModelInfo,
    RequestDelta,
    RequestStream,
)

KV_WEIGHT = 8.0  # a full KV cache counts as this many requests in flight
PREFIX_SLACK = 4.0  # a replica holding the prompt's prefix is chosen while at most this much busier
PREFIX_CHARS = 256  # the prefix that keys affinity: this many characters of text, a quarter as many token ids
MAX_PREFIXES = 4096  # prefixes remembered (least recently used forgotten)


def prefix_key(prompt: Mapping[str, Any]) -> str | None:
    """A digest of the prompt's start, None when the prompt is shorter than one affinity prefix (no reuse to win)."""
    ids = prompt.get("prompt_token_ids")
    if ids is not None:
        head: Any = list(ids)[: PREFIX_CHARS // 4]
        long_enough = len(ids) >= PREFIX_CHARS // 4
    else:
        text = prompt.get("prompt")
        if text is None:
            text = json.dumps(prompt.get("messages", ""), sort_keys=True)
        head, long_enough = str(text)[:PREFIX_CHARS], len(str(text)) >= PREFIX_CHARS
    if not long_enough:
        return None
    return hashlib.blake2b(repr(head).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class ReplicaLoad:
    in_flight: int
    kv_usage: float
    available: bool

    @property
    def score(self) -> float:
        return self.in_flight + KV_WEIGHT * self.kv_usage


class Router:
    """Picks a replica per request: least loaded, or the one that served the prompt's prefix when that pays."""

    def __init__(self) -> None:
        self.prefixes: OrderedDict[str, int] = OrderedDict()
        self.prefix_routed = 0

    def pick(self, loads: Sequence[ReplicaLoad], key: str | None) -> int | None:
        candidates = [i for i, load in enumerate(loads) if load.available]
        if not candidates:
            return None
        best = min(candidates, key=lambda i: (loads[i].score, i))
        chosen = best
        if key is not None:
            held = self.prefixes.get(key)
            if held is not None and held in candidates and loads[held].score <= loads[best].score + PREFIX_SLACK:
                chosen = held
                self.prefix_routed += chosen != best
            self.prefixes[key] = chosen
            self.prefixes.move_to_end(key)
            while len(self.prefixes) > MAX_PREFIXES:
                self.prefixes.popitem(last=False)
        return chosen


class DataParallelClient:
    """N engine cores behind one API: `EngineClient`'s surface, requests spread by `Router`."""

    def __init__(
        self, model: str | None, engine_kwargs: Mapping[str, Any] | None, size: int,
        make_client: Callable[[str | None, dict[str, Any]], EngineClient] = EngineClient,
    ) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        self.model = model
        self.replicas = [make_client(model, dict(kw)) for kw in replica_kwargs(engine_kwargs or {}, size)]
        self.router = Router()
        self.resubmitted = 0  # requests sent again after their replica died before their first delta

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> ModelInfo:
        """Start every engine core (in parallel); the server needs them all at first."""
        infos = await asyncio.gather(*(c.start(timeout_s) for c in self.replicas))
        return infos[0]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.replicas))

    # ---- state as one engine ----------------------------------------------------------------------------------
    @property
    def info(self) -> ModelInfo | None:
        return next((c.info for c in self.replicas if c.info is not None), None)

    @property
    def alive(self) -> bool:
        return any(c.alive for c in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        if self.alive:
            return None
        return "; ".join(f"replica {i}: {c.dead_reason}" for i, c in enumerate(self.replicas))

    @property
    def restarting(self) -> bool:
        return not self.alive and any(c.restarting for c in self.replicas)

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.replicas)

    @property
    def core_pid(self) -> int | None:
        return next((c.core_pid for c in self.replicas if c.alive), None)

    @property
    def core_pids(self) -> list[int]:
        return [pid for c in self.replicas for pid in c.core_pids]

    @property
    def replica_states(self) -> list[dict[str, Any]]:
        return [state for c in self.replicas for state in c.replica_states]

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.replicas)

    @property
    def accepting(self) -> bool:
        return any(c.accepting for c in self.replicas)

    @accepting.setter
    def accepting(self, value: bool) -> None:
        for c in self.replicas:
            c.accepting = value

    @property
    def stats(self) -> dict[str, Any]:
        """The replicas' stats summed (counts, times, bytes); KV cache use averaged; routing counts added."""
        merged: dict[str, Any] = {}
        for c in self.replicas:
            for k, v in c.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    merged[k] = merged.get(k, 0) + v
        live = [c.stats.get("kv_cache_usage", 0.0) for c in self.replicas if c.stats]
        if live:
            merged["kv_cache_usage"] = sum(live) / len(live)
        merged["dp_replicas_alive"] = sum(c.alive for c in self.replicas)
        merged["dp_prefix_routed"] = self.router.prefix_routed
        merged["dp_resubmitted"] = self.resubmitted
        return merged

    # ---- requests ----------------------------------------------------------------------------------------------
    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(c.num_in_flight, float(c.stats.get("kv_cache_usage", 0.0)), c.alive and c.accepting)
                for c in self.replicas]

    def add(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams) -> RequestStream:
        """Send the request to the replica the router picks; raises EngineDeadError when none is serving."""
        return RoutedStream(self, request_id, dict(prompt), params)

    def submit(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams, exclude: int | None = None,
               ) -> tuple[int, RequestStream]:
        """Send the request to the replica the router picks (never `exclude`); raises EngineDeadError."""
        loads = self.loads()
        if exclude is not None:
            loads[exclude] = dataclasses.replace(loads[exclude], available=False)
        chosen = self.router.pick(loads, prefix_key(prompt))
        if chosen is None:
            raise EngineDeadError(self.dead_reason or "no engine core is accepting requests")
        return chosen, self.replicas[chosen].add(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        for c in self.replicas:
            c.abort(request_id)

    def abort_all(self, reason: str) -> None:
        for c in self.replicas:
            c.abort_all(reason)


class RoutedStream(RequestStream):
    """A request's deltas from its replica; sent again to another replica if its own dies before the first delta."""

    def __init__(self, dp: DataParallelClient, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> None:
        self.request_id, self.finished = request_id, False
        self.dp, self.prompt, self.params = dp, prompt, params
        self.replica, self.inner = dp.submit(request_id, prompt, params)
        self.started = False

    async def next(self) -> RequestDelta:
        while True:
            try:
                delta = await self.inner.next()
            except EngineDeadError:
                if self.started or self.finished or not self.resubmit():
                    self.finished = True
                    raise
                continue
            self.started, self.finished = True, delta.finished
            return delta

    def resubmit(self) -> bool:
        """Send the request to another live replica; False when none takes it."""
        try:
            self.replica, self.inner = self.dp.submit(self.request_id, self.prompt, self.params, exclude=self.replica)
        except EngineDeadError:
            return False
        self.dp.resubmitted += 1
        return True

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.inner.abort()


def replica_kwargs(engine_kwargs: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
    """Each replica's engine keywords: on the CPU its own share of the cores and of the host memory for the KV cache,
    on CUDA its own device(s) (a replica of tensor-parallel size t takes devices i t ... i t + t - 1), unless the
    caller placed them."""
    cores = sorted(os.sched_getaffinity(0))
    tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
    out = []
    for i in range(size):
        kw = dict(engine_kwargs)
        device = str(kw.get("device", "cpu"))
        if device.startswith("cpu"):
            # the replicas share the host's memory: each sizes its default KV cache from its share of it
            kw["kv_share"] = 1.0 / size
            if kw.get("cpu_cores") is None and len(cores) >= size:
                start, end = even_split(len(cores), size, i)
                kw["cpu_cores"] = tuple(cores[start:end])
        elif device == "cuda":
            kw["device"] = f"cuda:{i * tp}"
        out.append(kw)
    return out


def serving_client(
    model: str | None, engine_kwargs: Mapping[str, Any], data_parallel_size: int = 1, executor: str = "mp",
) -> EngineClient | DataParallelClient:
    """What `tandem serve` runs over: one engine core (a local child), or `data_parallel_size` of them behind a router,
    each a local child (`executor` "mp") or a Ray actor on any node of the cluster ("ray": `server/ray_cores.py`)."""
    if data_parallel_size == 1:
        return EngineClient(model, engine_kwargs)
    launcher: CoreLauncher = LocalCoreLauncher()
    if executor == "ray":
        from tandem.server.ray_cores import RayCoreLauncher

        launcher = RayCoreLauncher()
    return DataParallelClient(model, engine_kwargs, data_parallel_size, lambda m, kw: EngineClient(m, kw, launcher))


ServingClient = EngineClient | DataParallelClient  # noqa: UP007 (a runtime alias on Python 3.10): what the API serves over
