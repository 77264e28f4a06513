"""Timing one grammar's mask fills on one backend (benchmarks, and the crossover between the backends)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tandem.structured.backend import GrammarBackend, GrammarSpec, allowed_tokens, bitmask_words


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values` (0.0 when empty)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def measure_mask_fill(
    backend: GrammarBackend,
    spec: GrammarSpec,
    *,
    tokens: Sequence[int] | None = None,
    steps: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """Time `fill_bitmask` per row for one grammar on `backend`'s vocabulary.

    With `tokens` (a valid output's tokens), the matcher walks them and a mask is filled before each one; without,
    it walks `steps` random allowed tokens (a random-logits model), restarting when it terminates. Returns rows,
    compile_ms and the per-row p50 / p99 / mean in microseconds.
    """
    started = time.perf_counter()
    grammar = backend.compile(spec)
    compile_ms = 1e3 * (time.perf_counter() - started)
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, bitmask_words(backend.vocab_size)), dtype=np.int32)  # [1, W]
    matcher = backend.matcher(grammar)
    path = list(tokens) if tokens is not None else None
    durations: list[float] = []
    for step in range(len(path) if path is not None else steps):
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        durations.append(time.perf_counter() - t0)
        if path is not None:
            token = path[step]
        else:
            allowed = allowed_tokens(bitmask, 0, backend.vocab_size)
            token = int(rng.choice(allowed))
        if matcher.accept([token]) != 1:
            raise ValueError(f"token {token} at step {step} was not accepted")
        if matcher.is_terminated():
            matcher = backend.matcher(grammar)
    return {
        "rows": float(len(durations)),
        "compile_ms": compile_ms,
        "fill_us_p50": 1e6 * percentile(durations, 50),
        "fill_us_p99": 1e6 * percentile(durations, 99),
        "fill_us_mean": 1e6 * float(np.mean(durations)) if durations else 0.0,
    }
