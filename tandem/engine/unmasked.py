"""When to check the unmasked greedy rows' argmaxes, scheduling ahead: before the next launch, or after it.

A greedy row sampled without its grammar mask (engine/guidance.py) has its argmax validated by the grammar. Before
the launch of the next plan, that check holds every token of the plan for its time (the device waits); after the
launch, the next plan has been fed the unchecked argmax, so a rejected one is retracted (`Scheduler.retract`) and its
row thrown away: that request loses a step. `UnmaskedCheckPolicy` picks the side that loses fewer tokens, from the
measured time of a check and the measured share of argmaxes rejected:

    after the launch  when  rejected share  <  check time a row x the plan's tokens / forward time

With replayed outputs of a real model (no argmax rejected) and a 20 ms step at 256 rows, ~70 checks of ~12 us
(llguidance's `validate_tokens` and the Python around it) held the launch 0.94 ms a step, 4.7 % of it
(docs/benchmarks.md, issue 25); at batch 1 a check costs the plan 0.06 % of a step, so it stays before the launch
once anything is rejected. With noise logits (a third of the argmaxes rejected) it stays before at any batch size: on
two cores a retract-always variant filled the forward's window and its retracted rows cost 3-11 % more steps
(docs/benchmarks.md, issue 10). With speculation, a retracted row of the next plan is thrown away with the drafts it
verifies (made past the rejected token: their verification is never used).

A second instance (`LLMEngine.verify_checks`) decides the same for the tokens of drafts verified without masks
(one validation per request): after the launch, a rejected request is verified again with its masks, its tokens
are rewritten from the first that changed (`Scheduler.rewrite`) and its row of the next plan, drafts and all, is
thrown away. Replayed outputs at 256 rows: ~18 such checks a step, ~0.3 ms that held the launch.
"""

from __future__ import annotations

REJECT_SMOOTHING = 0.1  # weight of one step's rejected share in the running estimate
COST_SMOOTHING = 0.25  # weight of one step's check time a row


class UnmaskedCheckPolicy:
    """Measured cost and yield of the unmasked rows' checks; `after_launch` decides each step. Plain Python state."""

    def __init__(self, forced: bool | None = None) -> None:
        """`forced`: always after the launch (True) or always before it (False); None: by measurement."""
        self.forced = forced
        self.check_s = 0.0  # seconds one row's check took, smoothed (0 until measured: before the launch)
        self.rejected_share = 0.0  # rejected argmaxes / checked rows, smoothed

    def observe(self, rows: int, rejected: int, seconds: float) -> None:
        """One step's checks: `rows` argmaxes validated in `seconds`, `rejected` of them refused by their grammar."""
        if rows <= 0:
            return
        per_row = seconds / rows
        self.check_s = per_row if self.check_s == 0.0 else self.check_s + COST_SMOOTHING * (per_row - self.check_s)
        self.rejected_share += REJECT_SMOOTHING * (rejected / rows - self.rejected_share)

    def after_launch(self, plan_tokens: int, forward_s: float) -> bool:
        """Check after the next launch (retracting the rejected) rather than before it, for a plan of `plan_tokens`
        tokens whose forward takes `forward_s`: a retracted row loses one token, a check before the launch delays
        all of them."""
        if self.forced is not None:
            return self.forced
        if self.check_s <= 0.0 or forward_s <= 0.0:
            return False
        return self.rejected_share < self.check_s * plan_tokens / forward_s
