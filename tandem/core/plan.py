"""`StepPlan`: the only contract between the scheduler (CPU bookkeeping) and the model runner (device work).

Plain data only: lists of ints, so a plan can be logged, tested without a model, or sent to another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner feeds `input_ids` at positions `start_pos, start_pos + 1, ...` and writes their K/V into the slots
    `block_table[p // block_size] * block_size + p % block_size`. The last `num_draft_tokens` of `input_ids` are
    speculative drafts. When `needs_logits`, the runner returns `1 + num_draft_tokens` logits rows for this request:
    the rows of its last `1 + num_draft_tokens` input positions. With `all_logits` (prompt logprobs) it returns one row
    per input position, for every chunk.
    """

    request_id: str
    input_ids: list[int]
    start_pos: int
    block_table: list[int]  # once scheduled, replaced and never changed in place
    num_draft_tokens: int = 0
    needs_logits: bool = True
    all_logits: bool = False  # prompt logprobs: one row per input position

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_logits_rows(self) -> int:
        if self.all_logits:
            return self.num_tokens
        return 1 + self.num_draft_tokens if self.needs_logits else 0

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_draft_tokens > 1


@dataclass
class PlanEdits:
    """What the scheduler changed in a plan's rows after scheduling it and before its launch (scheduling ahead:
    `feed`, `settle`, `add_drafts`, `withdraw`), so that a runner which read the plan while the forward before it
    ran (core/plan_arrays.InputsAhead) puts the fed tokens into that read, and reads the plan again when rows were
    reshaped or withdrawn. Every change to a scheduled, unlaunched row is logged here: a fed token, or the row named
    as reshaped or withdrawn. Applying an entry twice, or to a read made after it, changes nothing. A fed row is
    named by its index in `requests` (mapping ~230 fed rows from their objects took 0.04-0.1 ms of the launch):
    valid while no row is withdrawn, and a plan with rows withdrawn is read again. With drafts the plan may also be
    launched before its rows change (`outcome`: what `settle` will change, given to the runner with the plan)."""

    # (the row's index in the plan's requests, the index in its input_ids, the token)
    fed: list[tuple[int, int, int]] = field(default_factory=list)
    reshaped: list[ScheduledRequest] = field(default_factory=list)  # start, tokens, drafts or block table changed
    withdrawn: list[ScheduledRequest] = field(default_factory=list)  # taken out of the plan
    # the plan launched before its rows learn the outcome of the plan before it (`Scheduler.settled_edits`, in
    # `_Read.edits_flat`'s form): the runner puts it into its read; `settle` puts it into the rows after the launch
    outcome: list[int] | None = None


@dataclass
class StepPlan:
    """What one engine step runs. `requests` are in the order their logits rows come back; `edits`: the changes to
    its rows after scheduling (see `PlanEdits`)."""

    step_id: int
    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    edits: PlanEdits = field(default_factory=PlanEdits)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def num_logits_rows(self) -> int:
        return sum(r.num_logits_rows for r in self.requests)

    def is_empty(self) -> bool:
        return not self.requests
