"""Which grammar backend serves a request: `backend="auto"` routes by cost.

Measured on the demo model's 49k vocabulary and on o200k (docs/structured_conformance.md, `tandem bench structured
--distinct-schemas`): llguidance builds a grammar in about 1 ms (it computes masks lazily) and its mask fills cost
4-10 us per row on average; xgrammar precomputes a token-mask cache, 10 ms - 1.2 s per schema, after which its fills
are 7-70 us with a tighter tail on small vocabularies. So a grammar seen for the first time is served by llguidance
(the request starts sampling at once). A grammar requested `promote_after` times whose llguidance fills measure slow
(a mean of `PROMOTE_MIN_FILL_S` or more per row) gets an xgrammar compile in the background, and from then on each
backend's measured mean fill time for that very grammar decides. Either backend falls back to the other when it
rejects a feature.

Why the gate on the fill time: a promotion compiles on a core the forward may need, for 10 ms to seconds (3.6 s for a
string with `minLength` 768), and xgrammar's fills are not cheaper than llguidance's where those are already fast
(demo vocabulary: llguidance 8-17 us / row, xgrammar 7-70). On a 2-core CPU host, 32 requests with one such schema
ran at 0.66-0.91 of unguided with the promotion and 0.93-0.97 without it (docs/benchmarks.md, "Reasoning models").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

TextKey = tuple[str, str, str]  # (kind, text, whitespace): a grammar independent of the backend
OTHER = {"xgrammar": "llguidance", "llguidance": "xgrammar"}
_EWMA = 0.05  # weight of a new row's fill time in a grammar's running mean
PROMOTE_MIN_FILL_S = 50e-6  # llguidance's mean fill per row from which an xgrammar compile may pay (0: no gate)


@dataclass(frozen=True)
class Route:
    """The backends to try for a request, in order, and why the first one."""

    backends: tuple[str, ...]
    reason: str


class BackendRouter:
    """Per-grammar request counts and measured fill times (bounded LRU maps); thread-safe."""

    def __init__(self, promote_after: int, max_entries: int = 4096, promote_min_fill_s: float | None = None) -> None:
        self.promote_after = promote_after
        self.promote_min_fill_s = PROMOTE_MIN_FILL_S if promote_min_fill_s is None else promote_min_fill_s
        self.max_entries = max_entries
        self._seen: OrderedDict[TextKey, int] = OrderedDict()
        self._fill_s: OrderedDict[tuple[str, TextKey], float] = OrderedDict()  # (backend, grammar) -> mean s / row
        self._lock = threading.Lock()

    def route(self, requested: str, key: TextKey, cached: Callable[[str], bool]) -> Route:
        """Count one request for `key` and choose; `cached(backend)` says whether that backend holds it compiled."""
        if requested != "auto":
            return Route((requested,), f"{requested}: asked for by the request")
        self._count(key)
        if cached("xgrammar") and self._xgrammar_pays(key):
            return Route(("xgrammar", "llguidance"), "xgrammar: compiled masks cached, measured fastest for this grammar")
        if cached("llguidance"):
            return Route(("llguidance", "xgrammar"), "llguidance: cached")
        return Route(("llguidance", "xgrammar"), "llguidance: a new grammar; it compiles lazily in ~1 ms")

    def should_promote(self, key: TextKey) -> bool:
        """`key` has been asked for often enough, and its llguidance fills measured slow enough, that xgrammar's
        precompiled masks may pay."""
        with self._lock:
            if self.promote_after <= 0 or self._seen.get(key, 0) < self.promote_after:
                return False
            fill = self._fill_s.get(("llguidance", key))
            return self.promote_min_fill_s <= 0 or (fill is not None and fill >= self.promote_min_fill_s)

    def record_fill(self, backend: str, key: TextKey, seconds: float) -> None:
        """Fold one row's fill time into the grammar's running mean on `backend`."""
        k = (backend, key)
        with self._lock:
            old = self._fill_s.get(k)
            self._fill_s[k] = seconds if old is None else old + _EWMA * (seconds - old)
            self._fill_s.move_to_end(k)
            while len(self._fill_s) > self.max_entries:
                self._fill_s.popitem(last=False)

    def mean_fill_s(self, backend: str, key: TextKey) -> float | None:
        with self._lock:
            return self._fill_s.get((backend, key))

    def _xgrammar_pays(self, key: TextKey) -> bool:
        """Unmeasured xgrammar is tried once (that measures it); then the lower measured mean wins."""
        x, ll = self.mean_fill_s("xgrammar", key), self.mean_fill_s("llguidance", key)
        return x is None or ll is None or x <= ll

    def _count(self, key: TextKey) -> None:
        with self._lock:
            self._seen[key] = self._seen.get(key, 0) + 1
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
