"""`UnmaskedCheckPolicy` (engine/unmasked.py): the unmasked argmaxes are checked after the next launch only where a
retracted row (one token) costs less than holding every token of the plan for the checks."""

from __future__ import annotations

from tandem.engine.unmasked import UnmaskedCheckPolicy


def test_checks_move_after_the_launch_where_rejections_are_rarer_than_the_wait_they_cost() -> None:
    policy = UnmaskedCheckPolicy()
    assert not policy.after_launch(256, 0.02)  # nothing measured yet: before the launch
    for _ in range(20):
        policy.observe(rows=70, rejected=0, seconds=70 * 12e-6)  # replayed outputs: every argmax valid
    assert policy.check_s == 12e-6
    assert policy.after_launch(256, 0.02)  # 12 us x 256 / 20 ms = 0.15 tokens a row against none lost
    assert policy.after_launch(1, 0.02)  # at batch 1 too, while no argmax has been rejected
    for _ in range(40):
        policy.observe(rows=70, rejected=2, seconds=70 * 12e-6)  # a real model: ~3 % of the argmaxes rejected
    assert 0.02 < policy.rejected_share < 0.03
    assert policy.after_launch(256, 0.02)
    assert not policy.after_launch(32, 0.02)  # 12 us x 32 / 20 ms = 0.019 < 0.028
    assert not policy.after_launch(1, 0.02)
    for _ in range(40):
        policy.observe(rows=30, rejected=10, seconds=30 * 12e-6)  # noise logits: a third rejected
    assert not policy.after_launch(256, 0.02)
    policy.observe(rows=0, rejected=0, seconds=1.0)  # a step without unmasked rows teaches nothing
    assert policy.check_s == 12e-6


def test_a_forced_policy_ignores_the_measurements() -> None:
    policy = UnmaskedCheckPolicy(forced=True)
    assert policy.after_launch(1, 0.02)
    policy.forced = False
    policy.observe(rows=70, rejected=0, seconds=70 * 12e-6)
    assert not policy.after_launch(256, 0.02)
