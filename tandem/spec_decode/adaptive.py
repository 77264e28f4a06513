"""Adaptive speculation length: pick K per request per step from measured acceptance and measured step costs.

Model (every quantity measured online, EWMA-smoothed, so the choice is a deterministic function of the reports):
- acceptance: p_i = P(draft i accepted | drafts 1..i-1 accepted), per request and per position i = 1..k_max.
  A step with K drafts yields E(K) = 1 + sum_{j=1..K} prod_{i<=j} p_i tokens for the request (the 1 is the token
  the target samples anyway); with one rate a this is sum_{i=0..K} a^i.
- cost: the engine reports each step's verify (forward) seconds with its token count, and the drafting seconds. The
  verify time t(n) is interpolated from per-size buckets; drafting costs a measured time per drafted token.
- choice: a batch of B decoding requests that all draft K tokens runs B (1 + K) tokens, so the step costs
  cost(K) = t(B (1 + K)) + B K draft_per_token and this request's throughput is E(K) / cost(K). The K in
  [0, k_max] with the best throughput wins; K > 0 must beat K = 0 by `min_gain` (relative) or speculation is off.
  When the forward is compute bound (t linear in n) E(K) / (1 + K) < 1 makes K = 0 win for large batches.
- probing: a request kept at K = 0 for `probe_interval` steps, while the shared acceptance estimate would
  speculate, drafts one token once so that its acceptance estimate can recover.
- goodput guard (for drafters that share the target's cores, i.e. a draft model on a small host): the model above
  cannot see every cost, because a draft model competing for the target's cores slows the target's forward while it
  drafts. So the controller measures what it promises: emitted tokens per second over `guard_window` steps with
  speculation off, then over up to `guard_window` steps as chosen (cut short after 3 when clearly losing); unless
  speculating beat not speculating by `min_gain`, speculation stays off until the next measurement, which comes
  every `guard_period` steps (doubling, up to 8x, while the verdict repeats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np


@dataclass
class _RequestStats:
    acceptance: list[float]  # [k_max] EWMA of p_i, position i + 1
    steps_at_zero: int = 0


@dataclass
class _Bucket:
    num_tokens: float  # EWMA of the token counts that fell in this bucket
    seconds: float  # EWMA of their verify seconds
    seen: int = 0  # the step it was last observed at


@dataclass
class AdaptiveK:
    """Chooses the number of drafts per request per step; feed it acceptance and timing reports."""

    k_max: int
    acceptance_alpha: float = 0.1  # EWMA weight of a new acceptance observation
    cost_alpha: float = 0.2  # EWMA weight of a new timing observation
    prior_acceptance: float = 0.6  # p_i before anything was measured
    min_gain: float = 0.03  # K > 0 needs throughput >= (1 + min_gain) * throughput(K = 0)
    probe_interval: int = 64  # steps at K = 0 before probing with K = 1 (0: never probe)
    buckets_per_octave: int = 4  # resolution of the verify-time table in log2(num_tokens)
    # a bucket not observed for this many steps no longer shapes the verify time (see `verify_seconds`)
    stale_after: int = 16
    guard_window: int = 0  # steps per goodput measurement (0: no guard; the engine enables it for draft models)
    guard_period: int = 512  # steps between the starts of two measurements
    # [k_max] acceptance over all requests: the prior of a new request and of the probe decision
    _shared: list[float] = field(init=False, repr=False)
    _requests: dict[str, _RequestStats] = field(init=False, repr=False, default_factory=dict)
    _verify: dict[int, _Bucket] = field(init=False, repr=False, default_factory=dict)
    _draft_per_token: float = field(init=False, repr=False, default=0.0)
    _num_steps: int = field(init=False, repr=False, default=0)
    _drafts_since_step: int = field(init=False, repr=False, default=0)
    _guard_step: int = field(init=False, repr=False, default=0)  # steps since the last measurement began
    _guard_on: list[float] = field(init=False, repr=False, default_factory=lambda: [0.0, 0.0])  # tokens, seconds
    _guard_off: list[float] = field(init=False, repr=False, default_factory=lambda: [0.0, 0.0])
    _pending_tokens: int = field(init=False, repr=False, default=0)
    _guard_scale: int = field(init=False, repr=False, default=1)  # period multiplier after repeated verdicts
    _cost_cache: dict[int, list[float]] = field(init=False, repr=False, default_factory=dict)  # see _costs
    _curve_cache: tuple[list[float], list[float]] | None = field(init=False, repr=False, default=None)  # see _curve
    speculation_off: bool = field(init=False, default=False)  # the guard's verdict until its next measurement

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        self._shared = [self.prior_acceptance] * self.k_max

    # ---- reports -----------------------------------------------------------------------------------------------
    def observe_acceptance(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """Record that `num_accepted` of `num_drafted` drafts were accepted (a prefix, so positions
        1..num_accepted succeeded and position num_accepted + 1 failed when it was drafted)."""
        stats = self._stats(request_id)
        tried = min(num_accepted + 1, num_drafted, self.k_max)
        for i in range(tried):
            hit = 1.0 if i < num_accepted else 0.0
            stats.acceptance[i] += self.acceptance_alpha * (hit - stats.acceptance[i])
            self._shared[i] += self.acceptance_alpha * (hit - self._shared[i])

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float) -> None:
        """Record one step: the forward over `num_tokens` tokens took `seconds`, drafting took `draft_seconds`
        (the time not hidden behind the forward) for the drafts chosen since the previous step."""
        self._num_steps += 1
        if num_tokens > 0:
            key = self._bucket_key(num_tokens)
            bucket = self._verify.get(key)
            if bucket is None or self._num_steps - bucket.seen >= self.stale_after:  # a stale bucket starts anew
                self._verify[key] = _Bucket(float(num_tokens), float(seconds), self._num_steps)
            else:
                bucket.num_tokens += self.cost_alpha * (num_tokens - bucket.num_tokens)
                bucket.seconds += self.cost_alpha * (seconds - bucket.seconds)
                bucket.seen = self._num_steps
        if self._drafts_since_step > 0:
            per_token = draft_seconds / self._drafts_since_step
            self._draft_per_token += self.cost_alpha * (per_token - self._draft_per_token)
        self._drafts_since_step = 0
        self._cost_cache.clear()
        self._curve_cache = None
        self._guard_observe(seconds + draft_seconds)

    def observe_emitted(self, num_tokens: int) -> None:
        """Tokens a request emitted this step (accepted drafts + 1): the guard's goodput numerator."""
        self._pending_tokens += num_tokens

    def _guard_phase(self) -> str:
        """'off' / 'on': measuring goodput with speculation off / as chosen; 'hold': acting on the last verdict."""
        if self.guard_window <= 0:
            return "hold"
        if self._guard_step < self.guard_window:
            return "off"
        if self._guard_step < 2 * self.guard_window:
            return "on"
        return "hold"

    def _guard_observe(self, seconds: float) -> None:
        phase = self._guard_phase()
        if phase != "hold":
            acc = self._guard_on if phase == "on" else self._guard_off
            acc[0] += self._pending_tokens
            acc[1] += seconds
        self._pending_tokens = 0
        self._guard_step += 1
        if phase == "on":
            on_steps = self._guard_step - self.guard_window
            (on_tok, on_s), (off_tok, off_s) = self._guard_on, self._guard_off
            losing_badly = on_steps >= 3 and on_s > 0 and off_s > 0 and on_tok / on_s < 0.8 * off_tok / off_s
            if on_steps == self.guard_window or losing_badly:  # verdict (early when clearly losing)
                if on_s > 0 and off_s > 0 and off_tok > 0:
                    off = on_tok / on_s < (1.0 + self.min_gain) * off_tok / off_s
                    # the same verdict again: measure half as often (up to 8x the base period)
                    same = off == self.speculation_off
                    self._guard_scale = min(8, self._guard_scale * 2) if same else 1
                    self.speculation_off = off
                self._guard_on, self._guard_off = [0.0, 0.0], [0.0, 0.0]
                self._guard_step = 2 * self.guard_window
        if self._guard_step >= max(self.guard_period * self._guard_scale, 2 * self.guard_window):
            self._guard_step = 0

    def release(self, request_id: str) -> None:
        """Forget the request's acceptance history."""
        self._requests.pop(request_id, None)

    # ---- decision ----------------------------------------------------------------------------------------------
    def choose(self, request_id: str, batch_size: int) -> int:
        """K for this request this step, in a decode batch of `batch_size` requests; counts k as drafted this step."""
        stats = self._stats(request_id)
        phase = self._guard_phase()
        if phase == "off" or (phase == "hold" and self.speculation_off):
            return 0
        k = self._best_k(stats.acceptance, batch_size)
        if k > 0:
            stats.steps_at_zero = 0
        else:
            stats.steps_at_zero += 1
            if (
                self.probe_interval > 0
                and stats.steps_at_zero >= self.probe_interval
                and self._best_k(self._shared, batch_size) > 0
            ):
                stats.steps_at_zero = 0
                k = 1
        self._drafts_since_step += k
        return k

    def choose_many(self, request_ids: Sequence[str], batch_size: int) -> list[int]:
        """`choose` for each of `request_ids` (a step's decode batch), in order: the same Ks and counts, the best K
        of every request found in one NumPy pass (256 requests, AMD EPYC: 0.28-0.58 ms one at a time, 0.19-0.30 ms
        so, by `k_max` 4-16; at `k_max` 4 0.08 ms since `_best_ks` goes K by K, 0.13 before: 2026-12-07)."""
        phase = self._guard_phase()
        if not request_ids or phase == "off" or (phase == "hold" and self.speculation_off):
            return [0] * len(request_ids)
        stats = [self._stats(rid) for rid in request_ids]
        best = self._best_ks([s.acceptance for s in stats], batch_size)
        ks: list[int] = []
        probe_k: int | None = None  # the probe's decision, the same for every request this step
        for s, k in zip(stats, best, strict=True):
            if k > 0:
                s.steps_at_zero = 0
            else:
                s.steps_at_zero += 1
                if self.probe_interval > 0 and s.steps_at_zero >= self.probe_interval:
                    probe_k = self._best_k(self._shared, batch_size) if probe_k is None else probe_k
                    if probe_k > 0:
                        s.steps_at_zero = 0
                        k = 1
            ks.append(k)
        self._drafts_since_step += sum(ks)
        return ks

    def expected_tokens(self, request_id: str, k: int) -> float:
        """E(K): expected tokens this request gains from a step with `k` drafts."""
        return self._expected_tokens(self._stats(request_id).acceptance, k)

    def step_seconds(self, batch_size: int, k: int) -> float:
        """Modelled cost of a step where `batch_size` decoding requests each draft `k` tokens."""
        batch = max(batch_size, 1)
        return self.verify_seconds(batch * (1 + k)) + batch * k * self._draft_per_token

    def verify_seconds(self, num_tokens: int) -> float:
        """Interpolated verify time for a forward over `num_tokens` tokens (1.0 before any measurement).

        Piecewise linear through the buckets' (tokens, seconds), made non-decreasing; flat below the smallest,
        and above the largest continued with the last segment's slope (flat when only one bucket is known).

        Only buckets observed within the last `stale_after` steps count (at least the two seen last): a step size
        that the choice stopped using is never re-measured, so one slow measurement of it (a forward on the host's
        cores beside a burst of host work) kept K below it for good. Measured: the demo model with suffix drafts,
        copy task at batch 1 scheduled ahead, a 5-token forward taken once at 35 ms (23.6 ms synchronously) held K
        at 1 for the whole run, 1.83 tokens a step against 3.07 synchronously. Forgotten, the next choice
        extrapolates from the recent sizes and measures that size again (a stale bucket's next observation
        replaces it rather than averaging with it).
        """
        if not self._verify:
            return 1.0
        xs, ys = self._curve()
        n = float(num_tokens)
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            if len(xs) == 1:
                return ys[-1]
            width = xs[-1] - xs[-2]
            slope = (ys[-1] - ys[-2]) / width if width > 0 else 0.0
            return ys[-1] + slope * (n - xs[-1])
        for i in range(1, len(xs)):
            if n <= xs[i]:
                frac = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + frac * (ys[i] - ys[i - 1])
        return ys[-1]  # unreachable: n < xs[-1]

    # ---- internals ---------------------------------------------------------------------------------------------
    def _stats(self, request_id: str) -> _RequestStats:
        stats = self._requests.get(request_id)
        if stats is None:
            stats = self._requests[request_id] = _RequestStats(list(self._shared))
        return stats

    def _curve(self) -> tuple[list[float], list[float]]:
        """The verify-time curve's points (tokens ascending, seconds made non-decreasing) from the buckets that count
        (see `verify_seconds`), made once per `observe_step`."""
        if self._curve_cache is None:
            recent = sorted(self._verify.values(), key=lambda b: b.seen, reverse=True)
            fresh = [b for b in recent if self._num_steps - b.seen < self.stale_after]
            points = sorted((b.num_tokens, b.seconds) for b in (fresh if len(fresh) >= 2 else recent[:2]))
            ys: list[float] = []
            for _, y in points:
                ys.append(max(y, ys[-1]) if ys else y)
            self._curve_cache = ([x for x, _ in points], ys)
        return self._curve_cache

    def _bucket_key(self, num_tokens: int) -> int:
        return round(self.buckets_per_octave * math.log2(num_tokens))

    @staticmethod
    def _expected_tokens(acceptance: list[float], k: int) -> float:
        total, reach = 1.0, 1.0
        for p in acceptance[:k]:
            reach *= p  # P(drafts 1..i all accepted)
            total += reach
        return total

    def _costs(self, batch_size: int) -> list[float]:
        """step_seconds(batch_size, K) for K = 0..k_max, kept until the next `observe_step` changes the model
        (every request of a step asks for the same batch size: 256 requests made it 10 ms a step)."""
        costs = self._cost_cache.get(batch_size)
        if costs is None:
            costs = self._cost_cache[batch_size] = [self.step_seconds(batch_size, k) for k in range(self.k_max + 1)]
        return costs

    def _best_ks(self, acceptances: list[list[float]], batch_size: int) -> list[int]:
        """`_best_k` of each acceptance list [k_max], by the same float operations in the same order (a running
        product, then a running sum from 1.0, each divided by its K's cost; the first best K wins ties), over the
        requests at once, K by K (256 requests, k_max 4, AMD EPYC Zen 4, 2026-12-07: 48-68 us against 96-136 with
        cumprod / cumsum over a matrix made by `np.asarray`, 256 against 431 us with the caches flushed)."""
        if self.k_max == 0:
            return [0] * len(acceptances)
        costs, n = self._costs(batch_size), len(acceptances)
        p = np.fromiter(chain.from_iterable(acceptances), np.float64, n * self.k_max).reshape(n, self.k_max)
        base = 1.0 / costs[0]  # K = 0: one token
        best, best_rate = np.zeros(n, dtype=np.int64), np.full(n, base)  # [n], [n]
        reach, total = p[:, 0].copy(), np.ones(n)  # [n]: P(drafts 1..k accepted), E(K)
        for k in range(1, self.k_max + 1):
            if k > 1:
                reach *= p[:, k - 1]
            total += reach
            rate = total / costs[k]
            better = rate > best_rate
            best[better] = k
            best_rate = np.where(better, rate, best_rate)
        best[best_rate < base * (1.0 + self.min_gain)] = 0
        return best.tolist()

    def _best_k(self, acceptance: list[float], batch_size: int) -> int:
        """argmax_K E(K) / cost(K), with K > 0 only when it beats K = 0 by min_gain (ties: smaller K)."""
        costs = self._costs(batch_size)
        base = 1.0 / costs[0]
        best_k, best_rate = 0, base
        total, reach = 1.0, 1.0
        for k in range(1, self.k_max + 1):
            reach *= acceptance[k - 1]  # P(drafts 1..k all accepted): E(K) built up as K grows
            total += reach
            rate = total / costs[k]
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_rate < base * (1.0 + self.min_gain):
            return 0
        return best_k
