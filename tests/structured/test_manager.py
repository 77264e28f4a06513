"""StructuredOutputManager: async compiles, the byte-bounded cache, CPU-time timeouts, the bounded compile queue,
'auto' routing by cost and fallback, parallel fills, fault isolation of fills, moves after slow fills."""

from __future__ import annotations

import pickle
import re
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import GPT2Tokenizer

from tandem.params import StructuredOutputsParams
from tandem.structured import (
    GrammarCache,
    GrammarError,
    GrammarQueueFull,
    GrammarSpec,
    StructuredOutputConfig,
    StructuredOutputManager,
    allocate_bitmask,
    allowed_tokens,
    measure_mask_fill,
)
from tandem.structured import manager as manager_module
from tandem.structured.llguidance_backend import LLGuidanceBackend
from tandem.structured.manager import TIMED_FILL_EVERY, Slack
from tandem.structured.xgrammar_backend import XGrammarBackend

SHARED = Path(__file__).resolve().parents[2] / "../shared/data"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return GPT2Tokenizer.from_pretrained(SHARED / "tokenizers/gpt2")


@pytest.fixture(scope="module")
def backends(tokenizer: Any) -> dict[str, Any]:
    """Built once for the module and shared by the managers below (backends are stateless between compiles)."""
    v = len(tokenizer)
    return {
        "xgrammar": XGrammarBackend(tokenizer, v, [tokenizer.eos_token_id]),
        "llguidance": LLGuidanceBackend(tokenizer, v, [tokenizer.eos_token_id]),
    }


def make_manager(tokenizer: Any, backends: dict[str, Any], **config: Any) -> StructuredOutputManager:
    factories = {name: (lambda b=b: b) for name, b in backends.items()}
    return StructuredOutputManager(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], StructuredOutputConfig(**config), backend_factories=factories
    )


@pytest.fixture
def manager(tokenizer: Any, backends: dict[str, Any]) -> Any:
    m = make_manager(tokenizer, backends)
    yield m
    m.shutdown()


def wait(manager: StructuredOutputManager, rid: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := manager.poll(rid)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.002)
    return state


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def test_params_pickle() -> None:
    for params in [
        StructuredOutputsParams(json=PERSON, whitespace="flexible", backend="llguidance"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar='root ::= "x"', backend="auto"),
    ]:
        clone = pickle.loads(pickle.dumps(params))
        assert clone == params and GrammarSpec.from_params(clone) == GrammarSpec.from_params(params)


def test_lifecycle(manager: StructuredOutputManager, tokenizer: Any) -> None:
    manager.submit("r1", StructuredOutputsParams(json=PERSON))
    assert manager.poll("r1") in ("pending", "ready")  # never blocks
    assert wait(manager, "r1") == "ready"
    assert manager.backend_of("r1") == "llguidance" and manager.error("r1") is None  # auto: a new grammar -> llguidance
    assert "new grammar" in (manager.reason_of("r1") or "")
    tokens = encode(tokenizer, '{"name":"Bo","age":7}')
    eos = tokenizer.eos_token_id
    assert eos not in manager.allowed_tokens("r1")
    assert manager.validate_draft("r1", [*tokens, eos]) == len(tokens) + 1
    assert manager.accept("r1", tokens[:3]) == 3
    manager.rollback("r1", 1)
    assert manager.accept("r1", [*tokens[2:], eos, eos]) == len(tokens) - 2 + 1
    assert manager.is_terminated("r1")
    manager.release("r1")
    assert not manager.has_request("r1")
    with pytest.raises(KeyError):
        manager.poll("r1")
    manager.release("r1")  # idempotent


def test_cache_hit_is_ready_at_submit(manager: StructuredOutputManager) -> None:
    params = StructuredOutputsParams(regex=r"[A-Z]{2}\d{4}")
    manager.submit("a", params)
    assert wait(manager, "a") == "ready"
    stats = manager.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["compiles"]) == (0, 1, 1)
    manager.submit("b", params)
    assert manager.poll("b") == "ready"  # no compile, no wait
    stats = manager.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["compiles"]) == (1, 1, 1)
    assert stats["cache_entries"] == 1 and 0 < stats["cache_bytes"] <= stats["cache_capacity_bytes"]
    # whitespace does not split the cache for non-JSON kinds; it does for JSON
    manager.submit("c", StructuredOutputsParams(regex=r"[A-Z]{2}\d{4}", whitespace="flexible"))
    assert manager.poll("c") == "ready"
    manager.submit("d", StructuredOutputsParams(json=PERSON, whitespace="flexible"))
    manager.submit("e", StructuredOutputsParams(json=PERSON))
    assert wait(manager, "d") == wait(manager, "e") == "ready"
    assert manager.stats()["cache_entries"] == 3


def test_concurrent_submits_share_one_compile(tokenizer: Any, backends: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.structured.routing.PROMOTE_MIN_FILL_S", 0.0)  # promotion by count alone
    manager = make_manager(tokenizer, backends)
    params = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "maxItems": 7})
    for i in range(5):
        manager.submit(f"r{i}", params)
    assert all(wait(manager, f"r{i}") == "ready" for i in range(5))
    stats = manager.stats()
    assert len(manager.compile_durations_s("llguidance")) == 1 and stats["coalesced"] + stats["cache_hits"] == 4
    # asked for 4 times: xgrammar's precompiled masks are built once in the background (a promotion)
    assert stats["promotions"] == 1
    manager.shutdown()


def test_size_limit(tokenizer: Any, backends: dict[str, Any]) -> None:
    manager = make_manager(tokenizer, backends, max_grammar_bytes=100)
    big = StructuredOutputsParams(choice=[f"option-{i}" for i in range(20)])
    with pytest.raises(GrammarError, match="over the limit of 100"):
        manager.submit("big", big)
    assert not manager.has_request("big")
    manager.submit("small", StructuredOutputsParams(choice=["a", "b"]))
    assert wait(manager, "small") == "ready"
    manager.shutdown()


def test_bad_specs_fail_with_reason(manager: StructuredOutputManager) -> None:
    manager.submit("x", StructuredOutputsParams(regex="a(b", backend="xgrammar"))
    assert wait(manager, "x") == "failed"
    assert manager.error("x") is not None and manager.error("x").startswith("xgrammar: ")  # type: ignore[union-attr]
    assert manager.backend_of("x") is None
    with pytest.raises(RuntimeError, match="failed"):
        manager.accept("x", [1])
    # both backends reject: the message carries both reasons, and the second try fails at once (negative cache)
    manager.submit("y", StructuredOutputsParams(json={"type": "frobnicate"}))
    assert wait(manager, "y") == "failed"
    error = manager.error("y") or ""
    assert error.startswith("auto: llguidance: ") and "xgrammar: " in error and "frobnicate" in error
    compiles = manager.stats()["compiles"]
    manager.submit("z", StructuredOutputsParams(json={"type": "frobnicate"}))
    assert manager.poll("z") == "failed" and manager.error("z") == error
    assert manager.stats()["compiles"] == compiles


@pytest.mark.parametrize(
    "params, text",
    [
        (StructuredOutputsParams(regex=r"\p{Lu}+-\d+"), "ÄBC-12"),  # xgrammar: no Unicode classes
        (StructuredOutputsParams(regex=r"(?i)hello"), "HeLLo"),  # xgrammar: no inline flags
        (StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'), "(1+2)"),  # Lark
        (StructuredOutputsParams(json={"type": "string", "pattern": "^\\p{L}+$"}), '"héllo"'),  # schema pattern
    ],
)
def test_auto_falls_back_to_llguidance(manager: StructuredOutputManager, tokenizer: Any, params: Any, text: str) -> None:
    manager.submit("r", params)
    assert wait(manager, "r") == "ready", manager.error("r")
    assert manager.backend_of("r") == "llguidance"
    tokens = [*encode(tokenizer, text), tokenizer.eos_token_id]
    assert manager.accept("r", tokens) == len(tokens) and manager.is_terminated("r")
    # xgrammar alone refuses the same spec
    manager.submit("x", StructuredOutputsParams(**{**_fields(params), "backend": "xgrammar"}))
    assert wait(manager, "x") == "failed" and (manager.error("x") or "").startswith("xgrammar: ")
    # the rejection is remembered: 'auto' is served from the cache, without compiling again
    compiles = manager.stats()["compiles"]
    manager.submit("again", params)
    assert manager.poll("again") == "ready" and manager.backend_of("again") == "llguidance"
    assert manager.stats()["compiles"] == compiles


def _fields(params: StructuredOutputsParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in ("json", "regex", "choice", "grammar", "whitespace")} | {"json_object": params.json_object}


def test_llama_cpp_json_gbnf_falls_back(manager: StructuredOutputManager, tokenizer: Any) -> None:
    manager.submit("g", StructuredOutputsParams(grammar=(SHARED / "grammars/llama.cpp/json.gbnf").read_text()))
    assert wait(manager, "g") == "ready" and manager.backend_of("g") == "llguidance"


def test_explicit_backend_choice(manager: StructuredOutputManager) -> None:
    manager.submit("l", StructuredOutputsParams(choice=["x", "y"], backend="llguidance"))
    manager.submit("x", StructuredOutputsParams(choice=["x", "y"], backend="xgrammar"))
    assert wait(manager, "l") == wait(manager, "x") == "ready"
    assert (manager.backend_of("l"), manager.backend_of("x")) == ("llguidance", "xgrammar")


def test_compile_cpu_limit_kills_only_that_compile(tokenizer: Any, backends: dict[str, Any]) -> None:
    """xgrammar in worker processes with a tiny CPU budget: a big schema's compile is stopped and fails its request
    alone; a ready request and a small compile are unaffected, and the next compile gets a fresh worker."""
    isolated = XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], isolated=True, compile_cpu_limit_s=0.05)
    manager = make_manager(tokenizer, {**backends, "xgrammar": isolated}, backend="xgrammar")
    manager.submit("ok", StructuredOutputsParams(choice=["a", "b"]))
    assert wait(manager, "ok") == "ready"
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(120)}}
    manager.submit("big", StructuredOutputsParams(json=big))
    assert wait(manager, "big") == "failed" and "more than 0.05 s of CPU time" in (manager.error("big") or "")
    assert manager.accept("ok", encode(tokenizer, "a")) == 1
    manager.submit("ok2", StructuredOutputsParams(choice=["c", "d"]))
    assert wait(manager, "ok2") == "ready"
    with pytest.raises(RuntimeError, match="failed"):
        manager.fill_bitmask(["big"], allocate_bitmask(1, len(tokenizer)), [0])
    manager.shutdown()


@dataclass(frozen=True)
class _FakeGrammar:
    memory_bytes: int
    backend: str = "xgrammar"


class _GatedBackend:
    """Stands in for xgrammar: a compile spins on the CPU until its gate opens (outliving the timeout), then returns
    a grammar of a given size."""

    name = "xgrammar"

    def __init__(self, vocab_size: int, size: int) -> None:
        self.vocab_size = vocab_size
        self.size = size
        self.gate = threading.Event()
        self.finished = threading.Event()

    def compile(self, spec: GrammarSpec) -> _FakeGrammar:
        deadline = time.monotonic() + 10
        while not self.gate.is_set() and time.monotonic() < deadline:
            sum(range(1000))  # CPU work: the timeout counts the compile's own CPU time
        self.finished.set()
        return _FakeGrammar(self.size)

    def matcher(self, grammar: Any) -> Any:
        return object()

    def close(self) -> None:
        pass


def test_late_compile_result_is_bounded_and_ignored_by_its_request(tokenizer: Any) -> None:
    """A thread cannot be killed: its late grammar goes into the cache within the byte bound, the timed-out
    request stays failed (no half-built matcher), and a new request for the same spec is served from the cache."""
    fake = _GatedBackend(len(tokenizer), size=600)
    manager = StructuredOutputManager(
        tokenizer,
        len(tokenizer),
        [tokenizer.eos_token_id],
        StructuredOutputConfig(backend="xgrammar", compile_timeout_s=0.05, cache_bytes=1000),
        backend_factories={"xgrammar": lambda: fake},  # type: ignore[dict-item,return-value]
    )
    manager.submit("slow", StructuredOutputsParams(regex="a+"))
    assert wait(manager, "slow", timeout_s=5) == "failed"
    assert "CPU time" in (manager.error("slow") or "")
    fake.gate.set()
    assert fake.finished.wait(5)
    deadline = time.monotonic() + 5
    while manager.stats()["cache_entries"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert manager.poll("slow") == "failed" and "timed out" in (manager.error("slow") or "")
    stats = manager.stats()
    assert stats["cache_entries"] == 1 and stats["cache_bytes"] == 600 <= stats["cache_capacity_bytes"]
    assert stats["timeouts"] == 1
    manager.submit("retry", StructuredOutputsParams(regex="a+"))
    assert manager.poll("retry") == "ready"
    # a second spec evicts the first (600 + 600 > 1000)
    manager.submit("other", StructuredOutputsParams(regex="b+"))
    assert wait(manager, "other") == "ready"
    stats = manager.stats()
    assert stats["cache_entries"] == 1 and stats["cache_evictions"] == 1 and stats["cache_bytes"] <= 1000
    manager.shutdown()


def test_time_queued_does_not_count_against_the_timeout(tokenizer: Any) -> None:
    """One compile thread busy with a slow compile: a second compile waits in the queue far longer than the
    timeout, and still succeeds (only its own CPU time counts)."""
    fake = _GatedBackend(len(tokenizer), size=10)
    manager = StructuredOutputManager(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id],
        StructuredOutputConfig(backend="xgrammar", compile_timeout_s=0.3, num_threads=1),
        backend_factories={"xgrammar": lambda: fake},  # type: ignore[dict-item,return-value]
    )
    manager.submit("first", StructuredOutputsParams(regex="a+"))
    manager.submit("queued", StructuredOutputsParams(regex="b+"))
    assert wait(manager, "first", timeout_s=5) == "failed"  # spun past 0.3 s of CPU
    time.sleep(0.2)  # "queued" has now waited > 0.3 s in all, behind it
    assert manager.poll("queued") == "pending"
    fake.gate.set()
    assert wait(manager, "queued") == "ready"
    manager.shutdown()


def test_held_compiles_run_only_once_started(tokenizer: Any) -> None:
    """`hold_compiles`: a submitted grammar is registered, coalesced and counted against the queue at once, but
    compiles only after `start_compiles` (an engine beside an accelerator starts them with the forward it
    launches); jobs still held at shutdown never run."""
    fake = _GatedBackend(len(tokenizer), size=10)
    fake.gate.set()
    compiled: list[str] = []
    compile = fake.compile
    fake.compile = lambda spec: (compiled.append(spec.text), compile(spec))[1]  # type: ignore[method-assign]
    manager = StructuredOutputManager(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id],
        StructuredOutputConfig(backend="xgrammar", max_queued_compiles=2, num_threads=1),
        backend_factories={"xgrammar": lambda: fake},  # type: ignore[dict-item,return-value]
    )
    manager.hold_compiles()
    manager.submit("a", StructuredOutputsParams(regex="a+"))
    manager.submit("b", StructuredOutputsParams(regex="b+"))
    manager.submit("a2", StructuredOutputsParams(regex="a+"))  # joins a's job
    with pytest.raises(GrammarQueueFull, match="already compiling"):
        manager.submit("c", StructuredOutputsParams(regex="c+"))  # two distinct jobs held: the queue is full
    time.sleep(0.05)
    assert compiled == [] and manager.poll("a") == manager.poll("b") == "pending" and manager.num_compiling == 0
    manager.start_compiles()
    assert wait(manager, "a") == wait(manager, "b") == wait(manager, "a2") == "ready"
    assert sorted(compiled) == ["a+", "b+"]
    manager.submit("c", StructuredOutputsParams(regex="c+"))  # held again until started
    manager.submit("d", StructuredOutputsParams(regex="d+"))
    time.sleep(0.05)
    assert manager.poll("c") == "pending" and sorted(compiled) == ["a+", "b+"]
    manager.shutdown()
    time.sleep(0.05)
    assert sorted(compiled) == ["a+", "b+"]


def test_compile_queue_is_bounded(tokenizer: Any) -> None:
    fake = _GatedBackend(len(tokenizer), size=10)
    manager = StructuredOutputManager(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id],
        StructuredOutputConfig(backend="xgrammar", max_queued_compiles=2, num_threads=1),
        backend_factories={"xgrammar": lambda: fake},  # type: ignore[dict-item,return-value]
    )
    manager.submit("a", StructuredOutputsParams(regex="a+"))
    manager.submit("b", StructuredOutputsParams(regex="b+"))
    manager.submit("a2", StructuredOutputsParams(regex="a+"))  # the same grammar joins its job: no new slot
    with pytest.raises(GrammarQueueFull, match="already compiling"):
        manager.submit("c", StructuredOutputsParams(regex="c+"))
    assert not manager.has_request("c") and manager.stats()["queue_full"] == 1
    fake.gate.set()
    assert wait(manager, "a") == wait(manager, "b") == "ready"
    manager.submit("c", StructuredOutputsParams(regex="c+"))  # room again
    assert wait(manager, "c") == "ready"
    manager.shutdown()


def test_cache_byte_bound_with_real_grammars(tokenizer: Any, backends: dict[str, Any]) -> None:
    sizes = [backends["xgrammar"].compile(GrammarSpec("regex", f"[a-z]{{{i}}}")).memory_bytes for i in range(1, 7)]
    capacity = sum(sizes[:3])
    manager = make_manager(tokenizer, backends, backend="xgrammar", cache_bytes=capacity)
    for i in range(1, 7):
        manager.submit(f"r{i}", StructuredOutputsParams(regex=f"[a-z]{{{i}}}"))
        assert wait(manager, f"r{i}") == "ready"
        assert manager.stats()["cache_bytes"] <= capacity
    stats = manager.stats()
    assert stats["cache_evictions"] >= 3 and stats["cache_misses"] == 6
    manager.submit("again-first", StructuredOutputsParams(regex="[a-z]{1}"))  # evicted: compiles again
    assert wait(manager, "again-first") == "ready" and manager.stats()["cache_misses"] == 7
    manager.submit("again-last", StructuredOutputsParams(regex="[a-z]{6}"))  # most recent: still cached
    assert manager.poll("again-last") == "ready" and manager.stats()["cache_hits"] == 1
    manager.shutdown()


def test_grammar_cache_lru() -> None:
    cache = GrammarCache(100)
    cache.put(("b", "k", "1", "c"), _FakeGrammar(40))
    cache.put(("b", "k", "2", "c"), _FakeGrammar(40))
    assert cache.get(("b", "k", "1", "c")) is not None  # 1 is now most recent
    cache.put(("b", "k", "3", "c"), _FakeGrammar(40))  # evicts 2
    assert cache.get(("b", "k", "2", "c")) is None and cache.get(("b", "k", "1", "c")) is not None
    assert cache.bytes_used == 80 and cache.evictions == 1
    cache.put(("b", "k", "huge", "c"), _FakeGrammar(101))  # larger than the whole cache: not stored
    assert cache.get(("b", "k", "huge", "c")) is None and cache.bytes_used == 80
    cache.put(("b", "k", "1", "c"), _FakeGrammar(60))  # replacing an entry re-counts its bytes
    assert cache.bytes_used == 100 and len(cache) == 2


def test_fill_bitmask_parallel_matches_serial(tokenizer: Any, backends: dict[str, Any]) -> None:
    """40 requests, twice (xgrammar's rows in chunks on the pool, llguidance's in one batch) == each request's own
    mask; rows of unguided requests untouched."""
    manager = make_manager(tokenizer, backends, num_threads=2, min_rows_per_chunk=4)
    specs = [
        StructuredOutputsParams(json=PERSON),
        StructuredOutputsParams(regex=r"\d{2,5}", backend="llguidance"),
        StructuredOutputsParams(choice=["north", "south"]),
        StructuredOutputsParams(json_object=True, backend="llguidance"),
    ]
    prefixes = ['{"name":"', "1", "so", "{"]
    ids = [f"r{i}" for i in range(40)]
    for i, rid in enumerate(ids):
        manager.submit(rid, specs[i % 4])
    for i, rid in enumerate(ids):
        assert wait(manager, rid) == "ready"
        if i % 8 < 4:  # half of them advance a little
            prefix = encode(tokenizer, prefixes[i % 4])
            assert manager.accept(rid, prefix) == len(prefix)
    rows = list(range(1, 81, 2))  # guided rows are odd; even rows are unguided
    bitmask = allocate_bitmask(81, len(tokenizer))
    for _ in range(2):
        bitmask[:] = 0x5A5A5A5A
        manager.fill_bitmask(ids, bitmask, rows)
        assert (bitmask[0::2] == 0x5A5A5A5A).all()
        for rid, row in zip(ids, rows, strict=True):
            np.testing.assert_array_equal(allowed_tokens(bitmask, row, len(tokenizer)), manager.allowed_tokens(rid))
    stats = manager.stats()
    assert stats["rows_filled"] == 80 and stats["mask_fill_us_per_row_p99"] >= stats["mask_fill_us_per_row_p50"] > 0
    with pytest.raises(ValueError, match="int32"):
        manager.fill_bitmask(ids[:1], np.zeros((2, 3), np.int64), [0])
    with pytest.raises(ValueError, match="distinct"):
        manager.fill_bitmask(ids[:2], bitmask, [1, 1])
    manager.shutdown()


def test_fill_draft_bitmasks(manager: StructuredOutputManager, tokenizer: Any) -> None:
    """Row j is the mask after drafts[:j]; the walk stops at the first rejected draft; the matcher is unchanged."""
    manager.submit("d", StructuredOutputsParams(json=PERSON))
    assert wait(manager, "d") == "ready"
    good = encode(tokenizer, '{"name":"Ann"')
    bad = encode(tokenizer, "}")  # "age" is required
    drafts = [*good, *bad, *good]
    bitmask = allocate_bitmask(len(drafts) + 2, len(tokenizer))
    bitmask[len(good) + 2 :] = 7
    assert manager.fill_draft_bitmasks("d", drafts, bitmask, 1) == len(good) + 1
    assert (bitmask[0] == -1).all() and (bitmask[len(good) + 2 :] == 7).all()  # rows outside the walk untouched
    for j in range(len(good) + 1):
        np.testing.assert_array_equal(allowed_tokens(bitmask, 1 + j, len(tokenizer)), manager.allowed_tokens("d"))
        if j < len(good):
            assert manager.accept("d", [good[j]]) == 1
    manager.rollback("d", len(good))
    assert manager.validate_draft("d", good) == len(good)  # back at the start
    with pytest.raises(ValueError, match="do not fit"):
        manager.fill_draft_bitmasks("d", good, bitmask, len(bitmask) - 1)


def test_forced_tokens_and_stats(manager: StructuredOutputManager, tokenizer: Any) -> None:
    manager.submit("one", StructuredOutputsParams(choice=["The answer is 42"]))
    assert wait(manager, "one") == "ready"
    forced = manager.forced_tokens("one")
    assert forced and "The answer is 42".startswith(tokenizer.decode(forced))
    assert manager.validate_draft("one", forced) == len(forced)
    stats = manager.stats()
    assert stats["forced_tokens"] == len(forced)
    assert stats["compile_ms_p99"] >= stats["compile_ms_p50"] > 0
    assert len(manager.compile_durations_s()) == stats["compiles"] == 1
    assert all(isinstance(v, float) for v in stats.values())


def test_duplicate_request_id(manager: StructuredOutputManager) -> None:
    manager.submit("dup", StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="already"):
        manager.submit("dup", StructuredOutputsParams(regex="a"))


def test_lazy_backends_from_hf_tokenizer(tokenizer: Any) -> None:
    """Without factories the manager builds its backends from the tokenizer, padding the vocabulary to V."""
    v = len(tokenizer) + 31
    manager = StructuredOutputManager(tokenizer, v, [tokenizer.eos_token_id], StructuredOutputConfig(backend="llguidance"))
    manager.warm_up()
    manager.submit("r", StructuredOutputsParams(regex="[0-9]"))
    assert wait(manager, "r") == "ready"
    allowed = manager.allowed_tokens("r")
    assert len(allowed) >= 10 and allowed.max() < len(tokenizer)
    manager.shutdown()


def test_measure_mask_fill(backends: dict[str, Any], tokenizer: Any) -> None:
    spec = GrammarSpec.from_params(StructuredOutputsParams(json=PERSON))
    for backend in backends.values():
        timing = measure_mask_fill(backend, spec, tokens=encode(tokenizer, '{"name":"Al","age":3}'))
        assert timing["rows"] == len(encode(tokenizer, '{"name":"Al","age":3}'))
        assert timing["fill_us_p99"] >= timing["fill_us_p50"] > 0
        walk = measure_mask_fill(backend, spec, steps=16)
        assert walk["rows"] == 16


def test_auto_falls_back_to_xgrammar(manager: StructuredOutputManager, tokenizer: Any) -> None:
    """llguidance refuses `uniqueItems`; xgrammar takes the schema, and the request says why it serves it."""
    manager.submit("u", StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    assert wait(manager, "u") == "ready", manager.error("u")
    assert manager.backend_of("u") == "xgrammar"
    assert (manager.reason_of("u") or "").startswith("xgrammar: fallback, llguidance rejected it")
    tokens = [*encode(tokenizer, "[1,2]"), tokenizer.eos_token_id]
    assert manager.accept("u", tokens) == len(tokens)
    assert manager.stats()["fallbacks"] == 1


def test_routing_by_measured_cost() -> None:
    from tandem.structured.routing import BackendRouter

    router = BackendRouter(promote_after=2, promote_min_fill_s=0.0)
    key = ("json", "{}", "compact")
    cached: set[str] = set()
    first = router.route("auto", key, cached.__contains__)
    assert first.backends == ("llguidance", "xgrammar") and "new grammar" in first.reason
    assert not router.should_promote(key)
    cached.add("llguidance")
    assert "cached" in router.route("auto", key, cached.__contains__).reason and router.should_promote(key)
    cached.add("xgrammar")  # promoted: xgrammar is tried once unmeasured ...
    assert router.route("auto", key, cached.__contains__).backends[0] == "xgrammar"
    router.record_fill("xgrammar", key, 30e-6)
    router.record_fill("llguidance", key, 10e-6)  # ... then the lower measured mean wins
    assert router.route("auto", key, cached.__contains__).backends[0] == "llguidance"
    for _ in range(200):
        router.record_fill("llguidance", key, 90e-6)
    assert router.route("auto", key, cached.__contains__).backends[0] == "xgrammar"
    assert router.route("xgrammar", key, cached.__contains__).backends == ("xgrammar",)  # asked for: no choice


def test_promotion_waits_for_slow_llguidance_fills() -> None:
    """A grammar asked for often is promoted only once its llguidance fills measure slow: a compile on a core the
    forward may need does not pay where llguidance is already fast."""
    from tandem.structured.routing import PROMOTE_MIN_FILL_S, BackendRouter

    router = BackendRouter(promote_after=2)
    fast, slow = ("json", "{}", "compact"), ("json", "[]", "compact")
    for key in (fast, slow):
        for _ in range(3):
            router.route("auto", key, lambda b: b == "llguidance")
    assert not router.should_promote(fast)  # asked for often, fills not measured yet
    router.record_fill("llguidance", fast, 0.2 * PROMOTE_MIN_FILL_S)
    router.record_fill("llguidance", slow, 4 * PROMOTE_MIN_FILL_S)
    assert not router.should_promote(fast) and router.should_promote(slow)


def test_promotion_compiles_xgrammar_in_the_background(tokenizer: Any, backends: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.structured.routing.PROMOTE_MIN_FILL_S", 0.0)
    manager = make_manager(tokenizer, backends, promote_after=2)
    params = StructuredOutputsParams(json=PERSON)
    manager.submit("a", params)
    assert wait(manager, "a") == "ready" and manager.backend_of("a") == "llguidance"
    manager.submit("b", params)  # the second request for it: xgrammar compiles in the background
    assert manager.poll("b") == "ready" and manager.backend_of("b") == "llguidance"
    deadline = time.monotonic() + 20
    while manager.stats()["cache_entries"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    manager.submit("c", params)
    assert manager.poll("c") == "ready" and manager.backend_of("c") == "xgrammar"
    assert "measured fastest" in (manager.reason_of("c") or "")
    assert manager.stats()["promotions"] == 1
    manager.shutdown()


class _BrokenMatcher:
    """A matcher whose library call fails (as llguidance's lexer limits do on hostile regexes)."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        raise RuntimeError("lexer error: too many expressions constructed")

    def accept(self, tokens: Any) -> int:
        raise RuntimeError("lexer error: too many expressions constructed")


def test_a_failing_fill_ends_only_its_request(manager: StructuredOutputManager, tokenizer: Any) -> None:
    for rid in ("good", "bad"):
        manager.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(manager, rid) == "ready"
    manager._requests["bad"].matcher = _BrokenMatcher()  # type: ignore[assignment]
    bitmask = allocate_bitmask(2, len(tokenizer))
    failures = manager.fill_bitmask(["good", "bad"], bitmask, [0, 1])
    assert list(failures) == ["bad"] and "too many expressions" in failures["bad"]
    np.testing.assert_array_equal(allowed_tokens(bitmask, 0, len(tokenizer)), manager.allowed_tokens("good"))
    assert allowed_tokens(bitmask, 1, len(tokenizer)).tolist() == [tokenizer.eos_token_id]
    assert manager.stats()["fill_errors"] == 1


def test_batched_fills_time_one_in_n_and_a_slow_batch_times_the_next(tokenizer: Any, backends: dict[str, Any]) -> None:
    """llguidance rows go in batches, untimed; every TIMED_FILL_EVERY-th fill of a request is filled alone and
    timed (the router and the fill percentiles see only those). A batch over max_fill_ms makes the next fill of its
    requests a timed one, which ends a request whose fill is over the limit on its own."""
    manager = make_manager(tokenizer, backends, backend="llguidance")
    ids = ["a", "b", "c"]
    for rid in ids:
        manager.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(manager, rid) == "ready"
    bitmask = allocate_bitmask(3, len(tokenizer))
    key = manager._requests["a"].text_key
    timed = []
    for _ in range(TIMED_FILL_EVERY + 2):
        assert manager.fill_bitmask(ids, bitmask, [0, 1, 2]) == {}
        timed.append(manager._router.mean_fill_s("llguidance", key) is not None)
    assert timed.index(True) == TIMED_FILL_EVERY - 1 and all(timed[TIMED_FILL_EVERY - 1 :])
    stats = manager.stats()
    assert stats["rows_filled"] == 3 * (TIMED_FILL_EVERY + 2) and stats["mask_fill_us_per_row_p50"] > 0
    manager.config.max_fill_ms = 1e-6  # every batch is over it now
    assert manager.fill_bitmask(ids, bitmask, [0, 1, 2]) == {}  # batched: the rows are valid, no one to blame yet
    failures = manager.fill_bitmask(ids, bitmask, [0, 1, 2])  # each filled alone, timed: over the limit
    assert sorted(failures) == ids and all("llguidance: a mask took" in f for f in failures.values())
    manager.shutdown()


def test_fills_outside_batches_write_the_batched_rows_and_are_timed(tokenizer: Any, backends: dict[str, Any]) -> None:
    """`in_batches=False` (the late rows' refill, which must not queue behind a batch already filling): every row is
    filled alone, with the same bits as a batched fill, and each such fill is a timed one."""
    manager = make_manager(tokenizer, backends, backend="llguidance")
    ids = ["a", "b"]
    for rid in ids:
        manager.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(manager, rid) == "ready"
    batched, alone = allocate_bitmask(2, len(tokenizer)), allocate_bitmask(2, len(tokenizer))
    assert manager.fill_bitmask(ids, batched, [0, 1]) == {}
    assert all(manager._requests[rid].untimed_fills == 1 for rid in ids)
    assert manager.fill_bitmask(ids, alone, [0, 1], in_batches=False) == {}
    assert np.array_equal(batched, alone)
    assert all(manager._requests[rid].untimed_fills == 0 for rid in ids)
    manager.shutdown()


class _HeldBackend:
    """A backend whose batch calls are held until `release` is set (a long fill), noting where each was prepared
    and that one began."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.began = threading.Event()
        self.release = threading.Event()
        self.prepared_on: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prepare_batch(self, work: Any, bitmask: np.ndarray) -> Any:
        self.prepared_on = threading.get_ident()
        call = self._inner.prepare_batch(work, bitmask)

        def held() -> None:
            self.began.set()
            self.release.wait(10.0)
            call()

        return held


def test_start_fill_returns_once_its_batch_has_begun(tokenizer: Any, backends: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's Python runs on the calling thread and its library call has begun on a fill-pool thread when
    `start_fill` returns: that thread needs the GIL to start, which a caller that goes on running Python hands
    over only at the interpreter's switch interval (here set to 1 s). Its rows equal a synchronous fill's.
    (Negative control: no hand-over, `HANDOFF_WAIT_S = 0`, fails it.)"""
    monkeypatch.setattr(manager_module, "HANDOFF_WAIT_S", 5.0)  # a loaded machine's thread wake-up: not timed here
    held = _HeldBackend(backends["llguidance"])
    manager = make_manager(tokenizer, {"llguidance": held}, backend="llguidance")
    ids = ["a", "b", "c"]
    for rid in ids:
        manager.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(manager, rid) == "ready"
    bitmask = allocate_bitmask(3, len(tokenizer))
    held.release.set()
    assert manager.fill_bitmask(ids, bitmask, [0, 1, 2]) == {}  # the pool's threads exist (starting one hands over)
    held.release.clear()
    held.began.clear()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        pending = manager.start_fill(ids, bitmask, [0, 1, 2])
        began = held.began.is_set()  # (Python only since `start_fill` returned: no GIL released)
    finally:
        sys.setswitchinterval(interval)
        held.release.set()
    assert began and held.prepared_on == threading.get_ident()
    assert pending.result() == ({}, [])
    plain = make_manager(tokenizer, backends, backend="llguidance")
    for rid in ids:
        plain.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(plain, rid) == "ready"
    expected = allocate_bitmask(3, len(tokenizer))
    assert plain.fill_bitmask(ids, expected, [0, 1, 2]) == {}
    np.testing.assert_array_equal(bitmask, expected)
    manager.shutdown()
    plain.shutdown()


@pytest.mark.parametrize("room_s,filled", [(60.0, True), (-1.0, False)], ids=["far-deadline", "deadline-passed"])
def test_slack_rows_are_filled_before_the_deadline_or_left_as_skipped(tokenizer: Any, backends: dict[str, Any],
                                                                       room_s: float, filled: bool) -> None:
    """Rows that may stay untouched (`Slack`) and rows whose probe passed are filled after the required ones while
    the deadline allows, with the bits a plain fill gives; the rest are reported skipped and left all ones."""
    manager = make_manager(tokenizer, backends, backend="llguidance")
    ids = ["req", "slack", "probed"]
    for rid in ids:
        manager.submit(rid, StructuredOutputsParams(json=PERSON))
        assert wait(manager, rid) == "ready"
        text = encode(tokenizer, '{"name":"Ada')
        assert manager.accept(rid, text) == len(text)  # inside a string: free text
    plain, got = allocate_bitmask(3, len(tokenizer)), allocate_bitmask(3, len(tokenizer))
    assert manager.fill_bitmask(ids, plain, [0, 1, 2]) == {}
    letters = (encode(tokenizer, "q")[0],)
    pending = manager.start_fill(["req", "probed"], got, [0, 2], probe={"probed": letters},
                                 slack=Slack(["slack"], [1], time.perf_counter() + room_s))
    failures, skipped = pending.result()
    assert failures == {}
    assert np.array_equal(got[0], plain[0])
    if filled:
        assert skipped == [] and pending.num_slack_filled == 2
        assert np.array_equal(got, plain)
    else:
        assert sorted(skipped) == ["probed", "slack"] and pending.num_slack_filled == 0
        assert (got[1:] == -1).all()
    assert manager.stats()["slack_fills"] == (2 if filled else 0)
    manager.shutdown()


def test_slack_rows_stop_when_the_forward_is_done(tokenizer: Any, backends: dict[str, Any]) -> None:
    """`Slack.ends_with`: the forward's future; once it is done no slack row starts (a device ended early)."""
    manager = make_manager(tokenizer, backends, backend="llguidance")
    manager.submit("s", StructuredOutputsParams(json=PERSON))
    assert wait(manager, "s") == "ready"
    forward: Future[None] = Future()
    forward.set_result(None)
    got = allocate_bitmask(1, len(tokenizer))
    pending = manager.start_fill([], got, [], slack=Slack(["s"], [0], time.perf_counter() + 60.0, forward))
    assert pending.result() == ({}, ["s"])
    assert (got == -1).all()
    manager.shutdown()


class _SlowMatcher:
    """Wraps a real matcher; every fill burns `delay_s` of CPU (as xgrammar's fills do on some hostile regexes)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        start = time.thread_time()
        while time.thread_time() - start < self.delay_s:
            sum(range(1000))
        self.inner.fill_bitmask(bitmask, row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_slow_fill_moves_the_request_to_llguidance(tokenizer: Any, backends: dict[str, Any]) -> None:
    """auto request on xgrammar whose fill exceeds max_fill_ms: it continues on llguidance from where it was."""
    manager = make_manager(tokenizer, backends, max_fill_ms=20.0, promote_after=0)
    manager.submit("x", StructuredOutputsParams(json=PERSON))
    assert wait(manager, "x") == "ready"
    request = manager._requests["x"]
    request.grammar = backends["xgrammar"].compile(request.spec)  # as if promoted
    request.matcher = _SlowMatcher(backends["xgrammar"].matcher(request.grammar), 0.05)
    prefix = encode(tokenizer, '{"name":"Al')
    assert manager.accept("x", prefix) == len(prefix)
    bitmask = allocate_bitmask(1, len(tokenizer))
    assert manager.fill_bitmask(["x"], bitmask, [0]) == {}  # the slow row is valid; the request moves on
    assert manager.backend_of("x") == "llguidance" and "moved from xgrammar" in (manager.reason_of("x") or "")
    rest = [*encode(tokenizer, '","age":4}'), tokenizer.eos_token_id]
    assert rest[0] in allowed_tokens(bitmask, 0, len(tokenizer)) and rest[0] in manager.allowed_tokens("x")
    assert manager.accept("x", rest) == len(rest) and manager.is_terminated("x")
    assert manager.stats()["switches"] == 1
    manager.shutdown()


@pytest.mark.parametrize("setting,problem", [
    ({"unmasked_greedy": "false"}, "unmasked_greedy must be a bool, got 'false'"),
    ({"enable_in_reasoning": "true"}, "enable_in_reasoning must be a bool, got 'true'"),
    ({"unmasked_min_fill_ms": -1}, "unmasked_min_fill_ms must be >= 0, got -1"),
    ({"max_fill_ms": "fast"}, "max_fill_ms must be a float, got 'fast'"),
    ({"num_threads": True}, "num_threads must be an int, got True"),
    ({"min_rows_per_chunk": 0}, "min_rows_per_chunk must be > 0, got 0"),
])
def test_config_names_the_bad_setting(setting: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        StructuredOutputConfig(**setting)  # type: ignore[arg-type]
    assert StructuredOutputConfig(max_fill_ms=5).max_fill_ms == 5  # an int for a float setting is fine
