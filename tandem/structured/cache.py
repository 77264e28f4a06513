"""`GrammarCache`: compiled grammars in an LRU map bounded by their memory, shared by all requests."""

from __future__ import annotations

import threading
from collections import OrderedDict

from tandem.structured.backend import CompiledGrammar

CacheKey = tuple[str, str, str, str]  # (backend, kind, text, whitespace)


class GrammarCache:
    """An LRU map of compiled grammars bounded by the sum of their `memory_bytes` (thread-safe).

    Invariant: `bytes_used <= capacity` after every call; a grammar larger than the whole capacity is not stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes_used = 0
        self.evictions = 0
        self._entries: OrderedDict[CacheKey, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: CacheKey) -> CompiledGrammar | None:
        """The grammar for `key` (marked most recently used), or None."""
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
            return grammar

    def put(self, key: CacheKey, grammar: CompiledGrammar) -> None:
        """Insert (or refresh) `key`, then evict least recently used entries until within capacity."""
        size = int(grammar.memory_bytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes_used -= int(old.memory_bytes)
            if size > self.capacity:
                return
            self._entries[key] = grammar
            self.bytes_used += size
            while self.bytes_used > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.bytes_used -= int(evicted.memory_bytes)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)
