"""Scheduling ahead with a drafter that runs beside the device (a draft model in its worker): how many drafts per
step (K), and whether the running requests alternate in two groups, chosen per batch size from measurements.

Two ways to keep the device and the drafter busy at once (the engine's step, docs/architecture.md):
  * optimistic: every request is verified every step; while the device verifies step t, the drafter drafts step
    t + 1 past t's outcome taken as every draft accepted plus its own guess of the next token, so it drafts K + 1
    tokens a step, and those drafts hold only when that outcome happens (probability h = a^K g, with a the
    acceptance of one draft and g the share of guesses that come true);
  * alternating groups: half the requests are verified while the drafter drafts the other half from their real
    outcome (K tokens, always valid); each request is verified every other step.
With a verify forward of T seconds and the drafter taking D(B, n) seconds for a proposal of n draft steps for B
requests:

    optimistic(K): B * (h * (1 + a + ... + a^K) + (1 - h)) tokens per max(T, D(B, K + 1))
    groups(K):     B / 2 * (1 + a + ... + a^K) tokens per max(T, D(B / 2, K))
    off:           B tokens per T

The engine waits for the drafter when its proposal is late, so a K too large for the forward shows up as a longer
step in this model, and a drafter slower than the device turns speculation off. Every input is measured online
(EWMAs; medians of the last few for the drafter's proposals, per batch size and steps, and the forward):
`observe_proposal`, `observe_forward`, `observe_outcome` (acceptance, guesses); before a measurement the priors
below apply. Deterministic: the same reports, the same
choice.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.7
ALPHA = 0.1  # EWMA weight of a new observation
WINDOW = 9  # the drafter's and the forward's times: medians of the last few (one slow start or stall is not theirs)
MEASURED_STEPS = 4  # steps of a choice before its measured goodput replaces the model's
FRESH_STEPS = 256  # ... and for how many steps after it ran
HOPELESS = 0.5  # before any choice with drafts was measured, off wins only when the model gives drafting less
PROBE_STEPS = 64  # steps at K = 0 before one step at K = 1 measures the drafter and the acceptance again


def _bucket(batch: int) -> int:
    """Batch sizes share a drafter-speed estimate per power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch))))


@dataclass(frozen=True)
class AheadChoice:
    k: int  # drafts per request this step (0: speculation off)
    alternate: bool  # alternating groups instead of optimistic drafting
    goodput: float  # the model's tokens per second for the whole batch
    probe: bool = False  # K = 1 only to measure the drafter and the acceptance again


@dataclass
class AheadPolicy:
    """K and the way of overlapping, for a batch of B decoding requests (module doc)."""

    k_max: int
    alternate: bool | None = None  # None: whichever the model prefers; True / False: forced
    acceptance: float = PRIOR_ACCEPTANCE  # EWMA of one draft's acceptance (given the drafts before it were)
    guesses: float = PRIOR_ACCEPTANCE  # EWMA of guesses of the token after the drafts that came true
    forward_s: float = 0.0  # the verify forward's seconds (0: not measured yet)
    _forwards: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    # (batch bucket, draft steps) -> the drafter's recent seconds for such a proposal (feeding the new tokens, the
    # round trip to its process and each step: the fixed part is as real as the rest)
    _proposals: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    # (batch bucket, K, alternate) -> recent steps with that choice: (tokens emitted, wall seconds). The goodput
    # measured so includes what the model misses (the drafter and the engine sharing the host's cores, drafts
    # dropped after a miss), and once there is some it decides instead of the model
    _steps: dict[tuple[int, int, bool], deque[tuple[int, float, int]]] = field(default_factory=dict)
    _clock: int = 0  # observed periods so far (measured goodput older than FRESH_STEPS of them is not used)
    _off_steps: int = 0  # consecutive choices of K = 0
    _probe_every: int = PROBE_STEPS  # doubles while probes keep finding speculation does not pay

    def observe_proposal(self, batch: int, steps: int, seconds: float) -> None:
        """The drafter answered a proposal of `steps` draft steps for `batch` requests in `seconds`."""
        if batch > 0 and steps > 0:
            self._proposals.setdefault((_bucket(batch), steps), deque(maxlen=WINDOW)).append(seconds)

    def observe_period(self, batch: int, choice: AheadChoice, seconds: float, tokens: int) -> None:
        """A step with `choice` for `batch` decoding requests took `seconds` of wall time and emitted `tokens`."""
        self._clock += 1
        if batch > 0 and not choice.probe:  # (a probe's steps wait for a drafter catching up: not its speed)
            key = (_bucket(batch), choice.k, choice.alternate)
            self._steps.setdefault(key, deque(maxlen=2 * WINDOW)).append((tokens, seconds, self._clock))

    def _measured(self, batch: int, k: int, alternate: bool) -> float | None:
        """The goodput measured with this choice lately (none when it ran too few steps, or too long ago: text
        and acceptance change, and a stale figure would keep a choice from being tried again)."""
        seen = [(n, dt) for n, dt, at in self._steps.get((_bucket(batch), k, alternate), ())
                if self._clock - at <= FRESH_STEPS]
        if len(seen) < MEASURED_STEPS:
            return None
        return sum(n for n, _ in seen) / max(1e-9, sum(dt for _, dt in seen))

    def _goodput(self, batch: int, k: int, alternate: bool, modelled: float, calibration: float) -> float:
        """Tokens per second with this choice: measured when it was used for a few steps, else the model's times
        what measured choices with drafts got of theirs (`calibration`: the model's error is much the same)."""
        measured = self._measured(batch, k, alternate)
        return measured if measured is not None else modelled * (calibration if k else 1.0)

    def observe_forward(self, seconds: float) -> None:
        """One forward's device seconds (the verify forward's time is the median of the recent ones: a prefill
        among them is not a decode step's length)."""
        self._forwards.append(seconds)
        self.forward_s = statistics.median(self._forwards)

    def observe_outcome(self, drafted: int, accepted: int, guess_right: bool | None) -> None:
        """One verification: `accepted` of `drafted` drafts; whether the guess past them came true (None: no guess,
        or not every draft was accepted)."""
        for i in range(drafted):
            if i > accepted:
                break
            self.acceptance = (1 - ALPHA) * self.acceptance + ALPHA * (1.0 if i < accepted else 0.0)
        if guess_right is not None:
            self.guesses = (1 - ALPHA) * self.guesses + ALPHA * (1.0 if guess_right else 0.0)

    def proposal_s(self, batch: int, steps: int) -> float | None:
        """Seconds of a proposal of `steps` draft steps for `batch` requests: the median measured for that size,
        else scaled by steps from the nearest measured one (batch sizes nearest first): a guess that a choice of it
        measures at once; None before any measurement."""
        if not self._proposals:
            return None
        b = _bucket(batch)
        key = (b, steps)
        if key in self._proposals:
            return statistics.median(self._proposals[key])
        near = min(self._proposals, key=lambda x: (abs(math.log2(x[0]) - math.log2(b)), abs(x[1] - steps)))
        return statistics.median(self._proposals[near]) * steps / near[1]

    def choose(self, batch: int) -> AheadChoice:
        """The best (K, way) for `batch` decoding requests; K = 1 until the drafter was measured. While K = 0 wins,
        two steps at K = 1 probe it again every so often (the interval doubles, up to 16x, while they agree). No
        request decoding (`batch` 0): K = 0, nothing modelled."""
        if batch <= 0:
            return AheadChoice(0, False, 0.0)
        best = self._best(batch)
        if best.k or not self.k_max:
            self._off_steps, self._probe_every = 0, PROBE_STEPS
            return best
        self._off_steps += 1
        if self._off_steps <= self._probe_every:
            return best
        if self._off_steps == self._probe_every + 2:  # the first catches the drafter up, the second times it
            self._off_steps, self._probe_every = 0, min(16 * PROBE_STEPS, 2 * self._probe_every)
        return AheadChoice(1, False, best.goodput, probe=True)

    def _best(self, batch: int) -> AheadChoice:
        t = self.forward_s
        if t <= 0 or self.proposal_s(batch, 2) is None:  # nothing measured yet: K = 1
            return AheadChoice(1 if self.k_max else 0, bool(self.alternate) and batch >= 2, 0.0, probe=True)
        models = self._models(batch, t)
        ratios = [m / models[key] for key in models if key[0] and (m := self._measured(batch, *key)) is not None]
        calibration = statistics.median(ratios) if ratios else 1.0
        off = self._goodput(batch, 0, False, batch / t, 1.0)
        best = AheadChoice(0, False, 0.0)
        for (k, alternate), model in models.items():
            rate = self._goodput(batch, k, alternate, model, calibration)
            if rate > best.goodput:
                best = AheadChoice(k, alternate, rate)
        # off needs a measured choice with drafts to lose to it (the model's acceptance and guesses start as
        # priors), unless the model finds drafting hopeless
        if best.goodput > off or (not ratios and best.goodput > HOPELESS * off):
            return best
        return AheadChoice(0, False, off)

    def _models(self, batch: int, t: float) -> dict[tuple[int, bool], float]:
        """The modelled goodput of each (K > 0, alternate) allowed (module doc)."""
        a, g = self.acceptance, self.guesses
        out: dict[tuple[int, bool], float] = {}
        for k in range(1, self.k_max + 1):
            run = sum(a**j for j in range(k + 1))  # 1 + a + ... + a^k
            if self.alternate is not True or batch < 2:
                h = a**k * g
                out[(k, False)] = batch * (h * run + (1 - h)) / max(t, self.proposal_s(batch, k + 1) or t)
            if self.alternate is not False and batch >= 2:
                out[(k, True)] = batch / 2 * run / max(t, self.proposal_s(math.ceil(batch / 2), k) or t)
        return out
