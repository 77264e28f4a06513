"""Continuous-batching scheduler (vLLM v1 style): every step, each request asks for the tokens it still lacks.

There are no prefill or decode phases. A running request needs `num_tokens - num_computed_tokens` more positions
computed (1 at steady decode, the rest of its prompt while prefilling, everything after a preemption), plus its
speculative drafts. Each step fills a token budget: running requests first, in admission order, then waiting ones
in FIFO order. When KV blocks run out, the most recently admitted running request is preempted (its blocks freed,
recomputed from scratch later, usually mostly from the prefix cache).

Step protocol with the engine: set `req.draft_token_ids` -> `schedule()` -> run the plan -> `update(plan, tokens)`
-> `finish(...)` the requests that hit a stop condition.

Scheduling ahead (the engine's asynchronous mode): `schedule(protected)` -> `reserve(plan)` accounts the plan
before it runs, appending to each request that will sample its drafts (taken as accepted) and a PLACEHOLDER token
(`req.num_tentative` counts that tail); the next plan is scheduled while this one runs and feeds those
placeholders; `resolve(plan, tokens, next_plan)` writes the sampled tokens over them (in the requests and in the next
plan's inputs) before the next plan is launched. With drafts, `settle(plan, tokens, next_plan, keep)` does this
instead, on the rows alone: a request whose drafts were all accepted keeps its row of the next plan, fed the
token (its drafts too when `keep` says they still hold), any other has that row moved back to where its accepted
tokens end, without drafts; the requests learn the outcome (and the KV slots of rejected drafts are released) in
`confirm()`, after the launch. A request whose token needs more work than the launch can wait for is
`withdraw`n from the next plan and resolved later; a token found wrong after that launch (an unmasked argmax the
grammar rejects) is `retract`ed: replaced, and the request's row in the running plan thrown away (the plan after it
feeds that position again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence

from tandem.config import SchedulerConfig
from tandem.core.kv_blocks import BlockManager
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.request import Request, RequestStatus

PLACEHOLDER = -1  # a token sampled by a plan still running (scheduling ahead); never a real token id
# a plan's rows that sample, each as (request id, row, its tokens when every draft is accepted, its request's row
# index in the next plan (-1: none), that row, and of that row (0 without one): its drafts, its start, whether it
# wants a logits row (0 / 1)), then where the row's accepted tokens end before its first draft: `pair_rows`
RowPairs = list[tuple[str, ScheduledRequest, int, int, "ScheduledRequest | None", int, int, int, int]]


class KVCacheTooSmallError(RuntimeError):
    """One request alone needs more KV blocks than the cache has (the engine should have rejected it)."""

    def __init__(self, request_id: str, num_positions: int, block_manager: BlockManager) -> None:
        bm = block_manager
        super().__init__(
            f"request {request_id!r} needs KV for {num_positions} positions "
            f"({bm.num_blocks_for(num_positions)} blocks) but the whole cache is num_blocks={bm.num_blocks} x "
            f"block_size={bm.block_size} = {bm.num_blocks * bm.block_size} positions; give the KV cache more "
            f"memory or lower max_model_len"
        )
        self.request_id = request_id


class Scheduler:
    """Decides which tokens of which requests each step computes; owns the waiting queue and the running list."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._waiting: deque[Request] = deque()  # FIFO; preempted requests re-enter at the front
        self._running: list[Request] = []  # admission order: the last one is the next preemption victim
        self._next_step_id = 0
        # settle's fed rows whose requests learn their tokens in `confirm`: {request: (its row of the settled plan, token)}
        self._unconfirmed: dict[str, tuple[ScheduledRequest, int]] = {}
        # settle's reshaped rows whose requests learn the outcome in `confirm`: {request: (its row of the settled
        # plan, its tokens, its row of the next plan, drafts dropped from that row or -1: moved back)}
        self._unsettled: dict[str, tuple[ScheduledRequest, Sequence[int], ScheduledRequest | None, int]] = {}

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def running(self) -> tuple[Request, ...]:
        """The running requests in admission order (read-only view for drafting)."""
        return tuple(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------------------------------ membership
    def add(self, req: Request) -> None:
        """Queue a new request at the back of the waiting queue (status WAITING)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request from wherever it is, free its blocks, mark it FINISHED_ABORTED; None if unknown."""
        req = self._remove(request_id)
        if req is not None:
            req.status = RequestStatus.FINISHED_ABORTED
        return req

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Remove a request that reached a stop condition, free its blocks and set its final `status`."""
        if not status.finished:
            raise ValueError(f"finish needs a finished status, got {status}")
        req = self._remove(request_id)
        if req is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        req.status = status

    def _remove(self, request_id: str) -> Request | None:
        req = self._requests.pop(request_id, None)
        self._unconfirmed.pop(request_id, None)
        self._unsettled.pop(request_id, None)
        if req is None:
            return None
        _drop_placeholders(req)
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self.block_manager.free(req)
        req.draft_token_ids = []
        return req

    # ---------------------------------------------------------------------------------------------- schedule
    def schedule(self, protected: frozenset[str] = frozenset(), parked: frozenset[str] = frozenset()) -> StepPlan:
        """Build the next step's plan: running requests (preempting on block shortage), then admissions.

        Changes: blocks allocated for every scheduled position, preempted requests moved to the front of the
        waiting queue, admitted ones moved to running, and `req.draft_token_ids` cut to the drafts scheduled.
        `protected` requests (in a plan still running) are never preempted: when only they could give blocks, the
        request that needs them waits for a later step instead. `parked` running requests sit this plan out.
        """
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens, protected, parked)
        self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, protected: frozenset[str], parked: frozenset[str]) -> int:
        """Schedule running requests in admission order; returns the budget left."""
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            if req.request_id in parked:
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens - req.hold_sampling, budget)
            if num_new <= 0:  # nothing to compute until the engine appends a token (or lifts the hold)
                i += 1
                continue
            num_drafts = self._num_schedulable_drafts(req, num_new, budget)
            placed = self._place(req, num_new, num_drafts, i, plan, protected)
            if placed is None:
                return budget  # req itself was preempted (it was the last running request)
            if placed < 0:
                i += 1  # no blocks without preempting a protected request: it waits
                continue
            plan.requests.append(self._scheduled(req, num_new, placed))
            budget -= num_new + placed
            i += 1
        return budget

    def _place(
        self, req: Request, num_new: int, num_drafts: int, index: int, plan: StepPlan, protected: frozenset[str]
    ) -> int | None:
        """Blocks for positions [0, computed + new + drafts): drop the drafts before preempting anyone for them.
        Returns the drafts that fit, None when `req` itself was preempted, -1 when it must wait."""
        bm = self.block_manager
        while not bm.ensure_slots(req, req.num_computed_tokens + num_new + num_drafts):
            if num_drafts:
                num_drafts = 0
                continue
            # the most recently admitted; never one already scheduled (those have index < i), nor a protected one
            victim = next((r for r in reversed(self._running[index:]) if r.request_id not in protected), None)
            if victim is None:
                return -1
            if victim is req and len(self._running) == 1:
                raise KVCacheTooSmallError(req.request_id, req.num_computed_tokens + num_new, bm)
            self._preempt(victim, plan)
            if victim is req:
                return None
        return num_drafts

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting requests in FIFO order while budget, `max_num_seqs` and blocks allow."""
        bm = self.block_manager
        preempted_now = set(plan.preempted_ids)
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            if req.request_id in preempted_now:
                return  # preempted ones sit at the front: nobody is admitted past them this step
            if not bm.admit(req, budget, use_prefix_cache=not self._wants_prompt_logprobs(req)):
                if not self._running:  # the whole cache is free and still too small for its first chunk
                    raise KVCacheTooSmallError(req.request_id, min(req.num_tokens, budget), bm)
                return
            self._waiting.popleft()
            req.status = RequestStatus.RUNNING
            self._running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens - req.hold_sampling, budget)
            if num_new > 0:
                plan.requests.append(self._scheduled(req, num_new, 0))
                budget -= num_new

    def _num_schedulable_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """Drafts ride along only at steady decode (exactly one non-draft token left), cut to budget and length."""
        if not req.draft_token_ids or req.num_tokens - req.num_computed_tokens != 1 or num_new != 1:
            return 0
        if self._wants_prompt_logprobs(req):
            return 0
        # draft j sits at position num_tokens + j (0-based): keep every position < max_model_len
        room = self.config.max_model_len - req.num_tokens
        return max(0, min(len(req.draft_token_ids), budget - 1, room))

    def _scheduled(self, req: Request, num_new: int, num_drafts: int) -> ScheduledRequest:
        """The plan entry for `num_new` tokens from `num_computed_tokens` on, then `num_drafts` drafts."""
        start = req.num_computed_tokens
        req.draft_token_ids = req.draft_token_ids[:num_drafts]  # what is not scheduled is dropped, not kept
        return ScheduledRequest(
            request_id=req.request_id,
            input_ids=req.token_ids[start : start + num_new] + req.draft_token_ids,
            start_pos=start,
            block_table=list(req.block_ids),
            num_draft_tokens=num_drafts,
            needs_logits=start + num_new == req.num_tokens,
            all_logits=self._wants_prompt_logprobs(req),
        )

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free all of a running request's KV; it recomputes prompt + outputs when re-admitted (front of queue)."""
        _drop_placeholders(req)
        self._running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._waiting.appendleft(req)
        plan.preempted_ids.append(req.request_id)

    @staticmethod
    def _wants_prompt_logprobs(req: Request) -> bool:
        """Still in its prompt with prompt logprobs requested: every position needs logits, no prefix-cache reuse."""
        return req.params.prompt_logprobs is not None and req.num_output_tokens == 0

    # ------------------------------------------------------------------------------------------------ update
    def update(self, plan: StepPlan, new_tokens: Mapping[str, Sequence[int]]) -> None:
        """Account a finished step: advance `num_computed_tokens`, append accepted tokens, roll back rejected drafts.

        `new_tokens[id]` (for entries with `needs_logits`) is the accepted drafts followed by one sampled token, already
        cut at stop conditions by the engine. Accepted drafts keep their KV; blocks past `num_tokens` are released;
        newly full blocks go to the prefix cache. Requests aborted or finished since `schedule()` are skipped.
        """
        bm = self.block_manager
        for sr in plan.requests:
            req = self._requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens != sr.start_pos:
                raise RuntimeError(
                    f"stale plan for {sr.request_id!r}: scheduled from position {sr.start_pos}, "
                    f"request is at {req.num_computed_tokens}"
                )
            accepted = list(new_tokens.get(sr.request_id, ())) if sr.needs_logits else []
            if sr.needs_logits:
                self._check_accepted(sr, accepted)  # before any change to req
            req.num_computed_tokens += sr.num_tokens - sr.num_draft_tokens
            if sr.needs_logits:
                # accepted drafts have valid KV; the sampled token has none yet
                req.num_computed_tokens += len(accepted) - 1
                req.append_tokens(accepted)
                req.draft_token_ids = []
                bm.truncate(req, req.num_tokens)  # keep blocks for positions < num_tokens (next input too)
            bm.commit(req)

    # ----------------------------------------------------------------------------------- scheduling ahead
    def reserve(self, plan: StepPlan) -> None:
        """Account `plan` before it runs: its positions count as computed, and each request that will sample gets
        its drafts (as if accepted) and a PLACEHOLDER token, the input of its next step: its tentative tail."""
        for sr in plan.requests:
            req = self._requests[sr.request_id]
            req.num_computed_tokens += sr.num_tokens
            if sr.needs_logits:
                k = sr.num_draft_tokens
                if k:
                    req.token_ids.extend(sr.input_ids[sr.num_tokens - k :])
                    req.draft_token_ids = []
                req.token_ids.append(PLACEHOLDER)
                req.num_tentative += k + 1

    @staticmethod
    def feed(tokens: Mapping[str, Sequence[int]], next_plan: StepPlan) -> None:
        """The tokens the running plan sampled (no drafts) go into `next_plan`'s inputs, over their placeholders:
        all that must happen before `next_plan` is launched (~0.2 us a row); `resolve` updates the requests after
        the launch. A request's placeholder is the last of its known tokens, so it is the last input of its row
        before the row's drafts, or not in the row."""
        fed = next_plan.edits.fed
        for i, sr in enumerate(next_plan.requests):
            ids = sr.input_ids
            at = len(ids) - 1 - sr.num_draft_tokens
            if at >= 0 and ids[at] == PLACEHOLDER:
                toks = tokens.get(sr.request_id)
                if toks:
                    ids[at] = toks[0]
                    fed.append((i, at, toks[0]))

    def resolve(self, plan: StepPlan, tokens: Mapping[str, Sequence[int]], next_plan: StepPlan | None,
                commit: bool = True) -> None:
        """The tokens `plan` sampled replace their placeholders, in the requests and, when given, in `next_plan`'s
        inputs (`feed`; the engine feeds before the launch and resolves after it); newly full blocks go to the prefix cache, unless `commit` is False (then
        call `commit(plan)` before the next `schedule`: after the launch, off the device's critical path). Requests
        that finished, were aborted or preempted meanwhile are skipped; a request that got no token keeps its
        placeholder."""
        if next_plan is not None:
            self.feed(tokens, next_plan)
        requests, running = self._requests, RequestStatus.RUNNING
        for sr in plan.requests:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue
            toks = tokens.get(rid)
            position = sr.start_pos + sr.num_tokens  # where the sampled token goes
            ids = req.token_ids
            if toks and position < len(ids) and ids[position] == PLACEHOLDER:
                ids[position] = toks[0]
                req.num_tentative -= 1
            if commit:
                self.block_manager.commit(req)

    def settle(self, plan: StepPlan, tokens: Mapping[str, Sequence[int]], next_plan: StepPlan,
               keep: Collection[str], pairs: RowPairs | None = None) -> list[str]:
        """Scheduling ahead with drafts, before `next_plan` is launched: the outcome of `plan` (accepted drafts and
        one sampled token per request; none for a request withdrawn or failed meanwhile) goes into `next_plan`'s
        rows. A request whose drafts were all accepted keeps its row, fed the sampled token, and keeps that row's
        drafts if it is in `keep` (they assumed this outcome). Any other has its row reshaped: without drafts, and
        moved back to where its accepted tokens end after a rejected draft. Only the rows change here: the requests'
        own token lists, positions and blocks (the KV slots of rejected drafts released) learn the outcome in
        `confirm`, after the launch. `pairs`: `pair_rows(plan, next_plan)`, taken while `plan` ran (read again
        when rows were withdrawn since). Returns the requests whose rows of `next_plan` lost their drafts or moved.
        Call `confirm()` (for all, or for the requests about to be read) before anything else reads the requests."""
        # on the launch's critical path (~1 us a row at 256 rows): locals, no property calls; the common row (every
        # draft accepted, its next row's drafts kept) only feeds its next row here
        if pairs is None or next_plan.edits.withdrawn:
            pairs = pair_rows(plan, next_plan)
        requests, running, changed = self._requests, RequestStatus.RUNNING, []
        unconfirmed, unsettled = self._unconfirmed, self._unsettled
        fed, reshaped = next_plan.edits.fed, next_plan.edits.reshaped
        for rid, sr, every, i, nxt, _, _, _, _ in pairs:
            toks = tokens.get(rid)
            if not toks:
                continue
            if len(toks) == every and (nxt is None or not nxt.num_draft_tokens or rid in keep):
                if nxt is not None:
                    nxt.input_ids[0] = toks[-1]
                    fed.append((i, 0, toks[-1]))
                unconfirmed[rid] = (sr, toks[-1])
                continue
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue
            unsettled[rid] = (sr, toks, nxt, _shrink(sr, toks, nxt, len(toks) == every))
            if nxt is not None:
                changed.append(rid)
                reshaped.append(nxt)
        return changed

    def settled_edits(self, plan: StepPlan, tokens: Mapping[str, Sequence[int]], next_plan: StepPlan,
                      keep: Collection[str], pairs: RowPairs | None = None) -> list[int]:
        """What `settle(plan, tokens, next_plan, keep, pairs)` will change in `next_plan`'s rows, changing nothing:
        the edits a runner puts into its read of `next_plan` (`_Read.edits_flat`'s form: the fed count, the fed (row,
        0, token), then each reshaped row as (row, start, 1, logits rows, -blocks used, its token): it keeps the
        first of the blocks it was read with), so that `next_plan` is launched first and settled after
        (`PlanEdits.outcome`). Rows must not be withdrawn from `next_plan` between the two calls, nor changed since
        `pairs` was taken."""
        if pairs is None or next_plan.edits.withdrawn:
            pairs = pair_rows(plan, next_plan)
        requests, running, bs, get = self._requests, RequestStatus.RUNNING, self.block_manager.block_size, tokens.get
        fed: list[int] = []
        reshaped: list[int] = []
        # `settle`'s walk, its choices only, on the launch's path after the host's sampling has flushed the caches:
        # from the pairs' numbers (taken while plan ran), the rows' objects not read; a reshaped row keeps the first
        # of the blocks it was read with (csrc/plan_ops.cpp: a record with -u)
        for rid, _, every, i, _, drafts, nxt_start, wants, accepted_end in pairs:
            toks = get(rid)
            if not toks or i < 0:
                continue
            n = len(toks)
            if n == every and (not drafts or rid in keep):
                fed += (i, 0, toks[-1])
                continue
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue
            # stripped of its drafts where it starts, or moved back to where the accepted tokens end
            start = nxt_start if n == every else accepted_end + n
            reshaped += (i, start, 1, wants, -(start // bs + 1), toks[-1])  # (one token at `start`)
        return [len(fed) // 3, *fed, *reshaped]

    def confirm(self, request_ids: Collection[str] | None = None) -> None:
        """The outcome `settle` put into the next plan's rows goes into the requests (`request_ids`, default all of
        them): their token lists, positions and blocks. After the launch, or before a request is read (a redraft)."""
        requests, running = self._requests, RequestStatus.RUNNING
        for pending, learn in ((self._unconfirmed, self._confirm), (self._unsettled, self._learn_reshaped)):
            rids = list(pending) if request_ids is None else [rid for rid in request_ids if rid in pending]
            for rid in rids:
                outcome = pending.pop(rid)
                req = requests.get(rid)
                if req is not None and req.status is running:
                    learn(req, *outcome)

    @staticmethod
    def _confirm(req: Request, sr: ScheduledRequest, last: int) -> None:
        """`sr`'s drafts all accepted and `last` sampled after them: its tentative tail up to `last` is known."""
        req.token_ids[sr.start_pos + len(sr.input_ids)] = last
        req.num_tentative -= sr.num_draft_tokens + 1

    def _learn_reshaped(self, req: Request, sr: ScheduledRequest, toks: Sequence[int], nxt: ScheduledRequest | None,
                        dropped: int) -> None:
        """The request of a row `settle` reshaped learns `sr`'s outcome `toks`: every draft accepted and its next
        row's `dropped` drafts gone (`dropped` >= 0), or a draft rejected (-1): its tokens end with `toks`, its next
        row (if any) is the sampled token alone. The blocks past its tokens are released."""
        if dropped >= 0:
            self._confirm(req, sr, toks[-1])
            del req.token_ids[len(req.token_ids) - 1 - dropped : len(req.token_ids) - 1]
            req.num_tentative -= dropped
            req.num_computed_tokens -= dropped
        else:
            first = sr.start_pos + sr.num_tokens - sr.num_draft_tokens  # the position of its first draft
            del req.token_ids[first:]
            req.token_ids.extend(toks)
            req.num_tentative = 0
            req.num_computed_tokens = first + len(toks) - 1  # the sampled token has no KV yet
            if nxt is not None:
                req.num_computed_tokens += 1
                req.token_ids.append(PLACEHOLDER)
                req.num_tentative = 1
        self._release_tail(req, nxt)

    def _release_tail(self, req: Request, row: ScheduledRequest | None) -> None:
        """Free the blocks past the request's tokens, and keep `row`'s block table to the blocks it still holds."""
        self.block_manager.truncate(req, len(req.token_ids))
        if row is not None and len(row.block_table) > len(req.block_ids):
            row.block_table = row.block_table[: len(req.block_ids)]  # replaced, not cut in place (see ScheduledRequest)

    def add_drafts(self, next_plan: StepPlan, drafts: Mapping[str, Sequence[int]]) -> int:
        """Drafts for rows of `next_plan` (reserved, not launched, without drafts): as many of each as fit the
        step's token budget, the model length and the blocks the request holds or can get from the free ones
        (never by preempting). Returns the drafts added."""
        room = self.config.max_num_batched_tokens - next_plan.num_tokens
        bm, added = self.block_manager, 0
        for sr in next_plan.requests:
            want = drafts.get(sr.request_id)
            req = self._requests.get(sr.request_id)
            if not want or req is None or sr.num_draft_tokens or not sr.needs_logits or sr.num_tokens != 1:
                continue
            first = sr.start_pos + 1  # the position of the first draft
            n = min(len(want), room, self.config.max_model_len - first)
            if n > 0 and not bm.ensure_slots(req, first + n):
                n = min(n, len(req.block_ids) * bm.block_size - first)  # the free blocks ran short: what fits
            if n <= 0:
                continue
            sr.block_table = sr.block_table + req.block_ids[len(sr.block_table) :]  # replaced (see ScheduledRequest)
            new = [int(t) for t in want[:n]]
            req.token_ids[len(req.token_ids) - 1 : len(req.token_ids) - 1] = new  # before the placeholder
            req.num_tentative += n
            req.num_computed_tokens += n
            sr.input_ids.extend(new)
            sr.num_draft_tokens = n
            next_plan.edits.reshaped.append(sr)
            room -= n
            added += n
        return added

    def commit(self, plan: StepPlan) -> None:
        """Offer the blocks of `plan`'s running requests that became full to the prefix cache (see `resolve`)."""
        for sr in plan.requests:
            req = self._requests.get(sr.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                self.block_manager.commit(req)

    def withdraw(self, plan: StepPlan, request_ids: Collection[str]) -> int:
        """Take `request_ids` out of `plan`, reserved but not launched, undoing `reserve` for them: their input (the
        token the running plan sampled) is not known in time, or it ends them. The next `schedule` takes them again
        once it is known (a request that ended is gone by then). Returns the rows taken out."""
        if not request_ids:
            return 0
        request_ids = set(request_ids)
        kept = []
        for sr in plan.requests:
            req = self._requests.get(sr.request_id)
            if sr.request_id not in request_ids or req is None:
                kept.append(sr)
                continue
            plan.edits.withdrawn.append(sr)
            if sr.needs_logits and req.token_ids and req.token_ids[-1] == PLACEHOLDER:
                del req.token_ids[len(req.token_ids) - 1 - sr.num_draft_tokens :]  # its drafts, the token to sample
                req.num_tentative -= 1 + sr.num_draft_tokens
            req.num_computed_tokens = sr.start_pos
        taken = len(plan.requests) - len(kept)
        plan.requests = kept
        return taken

    def retract(self, plan: StepPlan, request_id: str, position: int, token: int) -> bool:
        """Scheduling ahead: `plan` (launched) was fed `request_id`'s token at `position`, which turned out wrong
        (an unmasked argmax the grammar rejected, resolved or settled already); `token` replaces it. When `plan`
        computes that position, the request's row there is garbage: the position counts as not computed (the next
        `schedule` feeds it again, overwriting its KV slot after `plan` wrote it), the tentative tail `plan` was to
        sample into (its drafts, if the row verifies any, and the placeholder) is dropped and the blocks past the
        position released. Returns whether the row in `plan` is garbage (its logits must be thrown away)."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING or position >= len(req.token_ids):
            return False
        req.token_ids[position] = token
        sr = next((sr for sr in plan.requests if sr.request_id == request_id), None)
        if sr is None or not sr.start_pos <= position < sr.start_pos + sr.num_tokens:
            return False
        del req.token_ids[position + 1 :]  # the row's drafts and the placeholder `plan` samples into
        req.num_tentative = 0
        req.num_computed_tokens = position
        self.block_manager.truncate(req, len(req.token_ids))
        return True

    def rewrite(self, plan: StepPlan, request_id: str, position: int, tokens: Sequence[int]) -> bool:
        """Scheduling ahead: `plan` (launched) was scheduled, and the step before it settled, with tokens of
        `request_id` that turned out wrong from `position` on (drafts verified without masks, their grammar's check
        after the launch); `tokens` replace them. Everything from `position` on counts as not computed (the next
        `schedule` feeds it again, overwriting the KV slots `plan` and the step before wrote there), the tentative
        tail `plan` was to sample into is dropped and the blocks past the tokens released. Returns whether the
        request has a row in `plan`: garbage, drafts and all (its logits must be thrown away)."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING or position > len(req.token_ids):
            return False
        del req.token_ids[position:]
        req.token_ids.extend(int(t) for t in tokens)
        req.num_tentative = 0
        req.num_computed_tokens = max(0, min(req.num_computed_tokens, position, len(req.token_ids) - 1))
        self.block_manager.truncate(req, len(req.token_ids))
        return any(sr.request_id == request_id for sr in plan.requests)

    @staticmethod
    def _check_accepted(sr: ScheduledRequest, accepted: list[int]) -> None:
        k = sr.num_draft_tokens
        if not 1 <= len(accepted) <= 1 + k:
            raise ValueError(
                f"request {sr.request_id!r}: expected 1..{1 + k} new tokens (accepted drafts + one sampled), "
                f"got {len(accepted)}"
            )
        drafts = sr.input_ids[len(sr.input_ids) - k :] if k else []
        if accepted[:-1] != drafts[: len(accepted) - 1]:
            raise ValueError(
                f"request {sr.request_id!r}: accepted tokens {accepted[:-1]} are not a prefix of the drafts"
            )


def _drop_placeholders(req: Request) -> None:
    """Forget the tentative tail of plans in flight (the request leaves, or starts over)."""
    if req.num_tentative:
        del req.token_ids[len(req.token_ids) - req.num_tentative :]
        req.num_tentative = 0
    req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids))


def _shrink(sr: ScheduledRequest, toks: Sequence[int], nxt: ScheduledRequest | None, every: bool) -> int:
    """`nxt` (the next row of `sr`'s request, reserved, not launched; None: it has none) becomes `sr`'s sampled
    token alone: without its drafts when every draft of `sr` was accepted (`every`: `nxt` has drafts that assumed
    another outcome), else also moved back to where `toks` end. Returns the drafts dropped (-1: moved back)."""
    if nxt is None:
        return -1  # (`settle` feeds a row whose every draft was accepted when it has no next row)
    if every:
        k = nxt.num_draft_tokens
        nxt.input_ids[0] = toks[-1]
        del nxt.input_ids[len(nxt.input_ids) - k :]
        nxt.num_draft_tokens = 0
        return k
    first = sr.start_pos + sr.num_tokens - sr.num_draft_tokens  # the position of its first draft
    nxt.start_pos, nxt.input_ids, nxt.num_draft_tokens = first + len(toks) - 1, [toks[-1]], 0
    return -1


def pair_rows(plan: StepPlan, next_plan: StepPlan) -> RowPairs:
    """`plan`'s rows that sample, each with its request's row of `next_plan` (what `settle` walks; taken while
    `plan` runs). Both plans list the running requests in admission order (`_schedule_running`): `next_plan`'s rows
    are walked in step with `plan`'s, a map of them built only for a row out of step. The numbers of each pair are
    the rows' as they are now (`settled_edits` reads those, not the rows)."""
    nxt_rows = next_plan.requests
    pairs: RowPairs = []
    j, num_next, index = 0, len(nxt_rows), None
    for sr in plan.requests:
        rid = sr.request_id
        if j < num_next and nxt_rows[j].request_id == rid:
            i = j
            j += 1
        else:
            index = index if index is not None else {r.request_id: k for k, r in enumerate(nxt_rows)}
            i = index.get(rid, -1)
            j = i + 1 if i >= 0 else j
        if not sr.needs_logits:
            continue
        end = sr.start_pos + len(sr.input_ids) - sr.num_draft_tokens - 1
        if i < 0:
            pairs.append((rid, sr, sr.num_draft_tokens + 1, i, None, 0, 0, 0, end))
        else:
            nxt = nxt_rows[i]
            wants = int(nxt.needs_logits or nxt.all_logits)
            pairs.append((rid, sr, sr.num_draft_tokens + 1, i, nxt, nxt.num_draft_tokens, nxt.start_pos, wants, end))
    return pairs
