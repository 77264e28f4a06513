"""Adaptive K: the throughput model picks long drafts when they pay and turns speculation off when they do not."""

from __future__ import annotations

import random
from collections.abc import Callable

from tandem.spec_decode import AdaptiveK


def feed_acceptance(ak: AdaptiveK, request_id: str, accepted: int, times: int = 100) -> None:
    for _ in range(times):
        ak.observe_acceptance(request_id, ak.k_max, accepted)


def feed_costs(ak: AdaptiveK, verify: Callable[[int], float], draft_per_token: float = 0.0) -> None:
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        k = ak.choose("_timing", 1)  # the drafts chosen before a step are what its draft time is spread over
        ak.observe_step(n, verify(n), draft_per_token * k)
    ak.release("_timing")


def flat(n: int) -> float:
    return 0.010


def linear(n: int) -> float:
    return 0.0001 * n


def roofline(n: int) -> float:
    return max(0.010, 0.0001 * n)  # memory bound up to 100 tokens, compute bound after


def test_high_acceptance_and_cheap_verify_give_large_k() -> None:
    ak = AdaptiveK(k_max=8)
    feed_costs(ak, flat, draft_per_token=1e-5)
    feed_acceptance(ak, "r", accepted=8)
    assert ak.choose("r", batch_size=8) == 8


def test_low_acceptance_turns_speculation_off() -> None:
    ak = AdaptiveK(k_max=8, probe_interval=0)
    feed_costs(ak, lambda n: 0.010 + 0.00002 * n, draft_per_token=2e-4)
    feed_acceptance(ak, "r", accepted=0)
    assert ak.choose("r", batch_size=4) == 0
    feed_acceptance(ak, "good", accepted=8)
    assert ak.choose("good", batch_size=4) > 0  # same costs, other request: acceptance decides


def test_large_compute_bound_batch_turns_speculation_off() -> None:
    ak = AdaptiveK(k_max=6)
    feed_costs(ak, roofline)
    feed_acceptance(ak, "r", accepted=6)  # perfect acceptance still cannot beat a linear cost
    assert ak.choose("r", batch_size=1) >= 4  # small batch: the forward is memory bound, drafts are free
    assert ak.choose("r", batch_size=512) == 0
    linear_only = AdaptiveK(k_max=6)
    feed_costs(linear_only, linear)
    feed_acceptance(linear_only, "r", accepted=5)
    assert all(linear_only.choose("r", batch_size=b) == 0 for b in (1, 16, 256))


def test_expected_tokens_model() -> None:
    ak = AdaptiveK(k_max=4, prior_acceptance=0.5)
    assert ak.expected_tokens("r", 0) == 1.0
    assert abs(ak.expected_tokens("r", 3) - (1 + 0.5 + 0.25 + 0.125)) < 1e-12
    ak.observe_acceptance("r", 4, 1)  # position 1 accepted, position 2 rejected, 3-4 untried
    accept = ak._requests["r"].acceptance
    assert accept[0] > 0.5 > accept[1] and accept[2] == accept[3] == 0.5


def test_verify_time_interpolation() -> None:
    ak = AdaptiveK(k_max=2)
    assert ak.verify_seconds(10) == 1.0  # nothing measured yet
    ak.observe_step(10, 1.0, 0.0)
    assert ak.verify_seconds(1000) == 1.0  # one point: flat
    ak.observe_step(100, 2.0, 0.0)
    assert abs(ak.verify_seconds(55) - 1.5) < 1e-9
    assert abs(ak.verify_seconds(190) - 3.0) < 1e-9  # extrapolated with the last slope
    assert ak.verify_seconds(1) == 1.0


def test_deterministic_given_inputs() -> None:
    def run() -> list[int]:
        ak = AdaptiveK(k_max=5)
        rng = random.Random(7)
        choices = []
        for step in range(300):
            k = ak.choose("r", 4)
            choices.append(k)
            ak.observe_acceptance("r", k, sum(1 for _ in range(k) if rng.random() < 0.7))
            ak.observe_step(4 * (1 + k), roofline(4 * (1 + k)) + 0.0001 * (step % 3), 1e-4 * k)
        return choices

    assert run() == run()


def simulate(
    acceptance: dict[str, float], verify: Callable[[int], float], steps: int, k_max: int = 6
) -> tuple[AdaptiveK, dict[str, list[int]]]:
    """Requests whose drafts are accepted independently with a fixed rate; returns K chosen per step (the model
    alone: no goodput guard, which `test_guard_*` cover)."""
    ak = AdaptiveK(k_max=k_max, guard_window=0)
    rng = random.Random(11)
    history: dict[str, list[int]] = {rid: [] for rid in acceptance}
    for _ in range(steps):
        batch = len(acceptance)
        ks = {rid: ak.choose(rid, batch) for rid in acceptance}
        for rid, k in ks.items():
            history[rid].append(k)
            accepted = 0
            while accepted < k and rng.random() < acceptance[rid]:
                accepted += 1
            ak.observe_acceptance(rid, k, accepted)
        num_tokens = sum(1 + k for k in ks.values())
        ak.observe_step(num_tokens, verify(num_tokens) * (1 + 0.02 * rng.random()), 2e-5 * sum(ks.values()))
    return ak, history


def oracle_k(a: float, batch: int, verify: Callable[[int], float], k_max: int) -> int:
    def rate(k: int) -> float:
        return sum(a**i for i in range(k + 1)) / (verify(batch * (1 + k)) + 2e-5 * batch * k)

    return max(range(k_max + 1), key=rate)


def test_converges_under_simulated_workload() -> None:
    acceptance = {"easy": 0.9, "medium": 0.6, "hard": 0.02}
    ak, history = simulate(acceptance, roofline, steps=600)
    late = {rid: ks[-100:] for rid, ks in history.items()}
    assert sum(late["hard"]) <= 10  # off, apart from rare probes
    for rid in ("easy", "medium"):
        best = oracle_k(acceptance[rid], 3, roofline, 6)
        mean = sum(late[rid]) / len(late[rid])
        assert abs(mean - best) <= 1.0, (rid, mean, best)
    assert max(late["easy"]) == min(late["easy"]) == 6  # stable at the top once converged
    est = ak._requests["medium"].acceptance[0]
    assert abs(est - 0.6) < 0.2


def test_probe_recovers_a_request_stuck_at_zero() -> None:
    ak = AdaptiveK(k_max=4, probe_interval=5)
    feed_costs(ak, flat)
    feed_acceptance(ak, "other", accepted=4)  # the shared estimate says drafting pays
    feed_acceptance(ak, "r", accepted=0, times=200)
    feed_acceptance(ak, "other", accepted=4, times=200)
    ks = [ak.choose("r", 2) for _ in range(10)]
    assert ks == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    ak.release("r")
    assert "r" not in ak._requests


def _guarded_run(hidden_slowdown: float, acceptance: float, steps: int = 600) -> tuple[AdaptiveK, list[int]]:
    """One request; each step with drafts also costs `hidden_slowdown` x its time, which the reports do not show
    as verify or drafting time (a draft model competing for the target's cores). Returns K per step."""
    ak = AdaptiveK(k_max=4, guard_window=16)
    rng = random.Random(5)
    ks: list[int] = []
    for _ in range(steps):
        k = ak.choose("r", 1)
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        ak.observe_acceptance("r", k, accepted)
        ak.observe_emitted(accepted + 1)
        seconds = 0.010 * (1 + 0.02 * k) * (1 + (hidden_slowdown if k else 0.0))
        ak.observe_step(1 + k, seconds, 0.0)
    return ak, ks


def test_guard_turns_off_speculation_that_loses_in_wall_time() -> None:
    ak, ks = _guarded_run(hidden_slowdown=1.5, acceptance=0.3)  # the model sees a win, the wall clock a loss
    assert ak.speculation_off
    late = ks[-200:]
    assert sum(1 for k in late if k > 0) <= 3  # one measurement window cut short after 3 steps


def test_guard_keeps_speculation_that_wins() -> None:
    ak, ks = _guarded_run(hidden_slowdown=0.1, acceptance=0.8)
    assert not ak.speculation_off
    late = ks[-200:]
    assert sum(1 for k in late if k == 0) <= ak.guard_window  # off only while measuring the baseline


def test_a_stale_slow_measurement_stops_holding_k_down() -> None:
    """A 5- and a 9-token forward measured slow once (a burst of host work beside them on the same cores) hold K
    below them while fresh; after `stale_after` steps without those sizes the choice extrapolates from the sizes
    measured since, tries the longer drafts again and keeps them at their real cost."""
    def true_cost(n: int) -> float:
        return 0.012 + 0.0008 * n

    ak = AdaptiveK(k_max=8, stale_after=16, probe_interval=0)
    feed_acceptance(ak, "r", accepted=8)
    ak.observe_step(9, 0.080, 0.0)
    ak.observe_step(5, 0.070, 0.0)
    ak.observe_step(2, true_cost(2), 0.0)
    ak.observe_step(1, true_cost(1), 0.0)
    chosen = []
    for _ in range(48):
        k = ak.choose("r", 1)
        chosen.append(k)
        ak.observe_step(1 + k, true_cost(1 + k), 0.0)
    assert max(chosen[:8]) <= 1  # held down by the slow measurements while they are fresh
    assert min(chosen[-16:]) >= 6  # then the real costs: long drafts pay at this acceptance
    fresh = AdaptiveK(k_max=8, stale_after=10**9, probe_interval=0)  # never forgetting: held down for good
    feed_acceptance(fresh, "r", accepted=8)
    for n, s in ((9, 0.080), (5, 0.070), (2, true_cost(2)), (1, true_cost(1))):
        fresh.observe_step(n, s, 0.0)
    for _ in range(48):
        k = fresh.choose("r", 1)
        fresh.observe_step(1 + k, true_cost(1 + k), 0.0)
    assert k <= 1


def test_choose_many_equals_choose_one_by_one() -> None:
    """A step's batch chosen at once (`choose_many`: every request's best K in one NumPy pass) gets the Ks that
    `choose` gives one request at a time, over a run where acceptance, step costs, probes and the goodput guard all
    move the choice (negative controls: the last best K winning ties in `_best_ks`, or no probes, fails it)."""
    def run(batched: bool) -> list[list[int]]:
        ak = AdaptiveK(k_max=6, probe_interval=5, guard_window=8, guard_period=64)
        rng = random.Random(3)
        rates = {f"r{i}": (0.0 if i % 4 == 0 else rng.random()) for i in range(40)}
        history = []
        for _ in range(400):
            rids = [rid for rid in rates if rng.random() < 0.9]
            ks = ak.choose_many(rids, len(rids)) if batched else [ak.choose(rid, len(rids)) for rid in rids]
            history.append(ks)
            for rid, k in zip(rids, ks, strict=True):
                accepted = 0
                while accepted < k and rng.random() < rates[rid]:
                    accepted += 1
                ak.observe_acceptance(rid, k, accepted)
                ak.observe_emitted(accepted + 1)
            num_tokens = sum(1 + k for k in ks)
            ak.observe_step(num_tokens, roofline(num_tokens) * (1 + 0.05 * rng.random()), 1e-5 * sum(ks))
        return history

    one_by_one = run(batched=False)
    assert run(batched=True) == one_by_one
    flat_ks = [k for ks in one_by_one for k in ks]
    assert 0 in flat_ks and max(flat_ks) >= 3 and len(set(flat_ks)) >= 3  # the run moved the choice
    assert AdaptiveK(k_max=0).choose_many(["a", "b"], 2) == [0, 0] and AdaptiveK(k_max=3).choose_many([], 4) == []
    tie = AdaptiveK(k_max=4, acceptance_alpha=1.0)
    tie.observe_acceptance("t", 4, 1)  # p1 = 1, p2 = 0: K = 1..4 expect the same tokens
    tie.observe_step(8, 0.01, 0.0)  # one size measured, no drafting cost: every K costs the same
    assert tie.choose_many(["t"], 4) == [tie.choose("t", 4)] == [1]  # the tie goes to the smallest K
