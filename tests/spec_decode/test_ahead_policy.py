"""The ahead policy: K and the way of overlapping a concurrent drafter with the device, per batch size, from the
drafter's measured proposals, the forward's time, acceptance, and (once a choice ran) its measured goodput."""

from __future__ import annotations

from tandem.spec_decode.ahead_policy import PROBE_STEPS, AheadChoice, AheadPolicy


def _measured(policy: AheadPolicy, batch: int, forward_s: float, per_step_s: float, fixed_s: float = 0.0) -> None:
    for _ in range(9):
        policy.observe_forward(forward_s)
        for steps in range(1, policy.k_max + 2):
            policy.observe_proposal(batch, steps, fixed_s + steps * per_step_s)
    for _ in range(50):  # an accurate drafter: 19 in 20 drafts accepted, guesses too
        policy.observe_outcome(4, 4, True)
        policy.observe_outcome(4, 3, None)


def test_nothing_measured_is_one_draft_not_waited_for() -> None:
    choice = AheadPolicy(k_max=4).choose(1)
    assert (choice.k, choice.probe) == (1, True)


def test_a_drafter_as_fast_as_the_forward_drafts_deep_and_a_slow_one_not_at_all() -> None:
    fast, slow = AheadPolicy(k_max=6), AheadPolicy(k_max=6)
    _measured(fast, 1, forward_s=0.017, per_step_s=0.003)
    _measured(slow, 1, forward_s=0.017, per_step_s=0.040)
    assert fast.choose(1).k >= 3
    assert slow.choose(1).k == 0


def test_k_grows_with_the_drafter_speed() -> None:
    ks = []
    for per_step in (0.012, 0.007, 0.004):
        policy = AheadPolicy(k_max=6)
        _measured(policy, 1, forward_s=0.017, per_step_s=per_step)
        ks.append(policy.choose(1).k)
    assert ks == sorted(ks) and ks[0] < ks[-1]


def test_alternating_groups_when_the_drafter_is_slow_at_the_full_batch() -> None:
    """Drafting 8 requests costs 3x drafting 4: two groups of 4 verify every other step with drafts from their
    real outcome, and win over drafting all 8 past the outcome in flight."""
    policy = AheadPolicy(k_max=4)
    for _ in range(9):
        policy.observe_forward(0.018)
        for steps in range(1, 6):
            policy.observe_proposal(8, steps, steps * 0.030)
            policy.observe_proposal(4, steps, steps * 0.008)
    for _ in range(50):
        policy.observe_outcome(4, 4, True)
    choice = policy.choose(8)
    assert choice.alternate and choice.k >= 1
    assert not AheadPolicy(k_max=4, alternate=False).choose(8).alternate  # forced off


def test_measured_goodput_overrules_the_model() -> None:
    """The model would speculate; the steps run so emitted fewer tokens per second than those without drafts:
    off wins once both are measured."""
    policy = AheadPolicy(k_max=2)
    _measured(policy, 4, forward_s=0.017, per_step_s=0.005)
    assert policy.choose(4).k > 0
    for _ in range(8):
        for k in (1, 2):
            policy.observe_period(4, AheadChoice(k, False, 0.0), 0.060, 4)  # slow steps in practice
        policy.observe_period(4, AheadChoice(0, False, 0.0), 0.018, 4)
    assert policy.choose(4).k == 0


def test_off_is_probed_again_and_less_often_while_it_stays_off() -> None:
    policy = AheadPolicy(k_max=2)
    _measured(policy, 1, forward_s=0.010, per_step_s=0.050)
    probes = [i for i in range(3 * PROBE_STEPS + 10) if policy.choose(1).probe]
    assert probes[:2] == [PROBE_STEPS, PROBE_STEPS + 1]  # two steps: catch up, then time the drafter
    assert probes[2] - probes[1] > PROBE_STEPS  # then the interval doubled


def test_no_request_decoding_chooses_nothing() -> None:
    """Every request prefilling (after aborts, or a burst of arrivals) with choices already measured: K = 0, no model
    of a batch of none (it divided by its zero goodput: the engine step raised ZeroDivisionError)."""
    policy = AheadPolicy(k_max=2)
    _measured(policy, 1, forward_s=0.017, per_step_s=0.005)
    for _ in range(8):
        for k in (0, 1, 2):
            policy.observe_period(1, AheadChoice(k, False, 0.0), 0.020, 2)
    assert policy.choose(0) == AheadChoice(0, False, 0.0)
    assert policy.choose(1).goodput > 0  # a batch of one is modelled and measured as before
