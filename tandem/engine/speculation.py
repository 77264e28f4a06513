"""Speculative decoding inside the engine: draft before the step, verify after it, learn, and look ahead.

Per step, for every running request in steady decode:
  1. drafts: from the look-ahead started during the previous step when its guess came true, else proposed now
     (this is time the device waits for the CPU, and is measured as such);
  2. the scheduler runs 1 + K positions; the sampler verifies them by rejection sampling (lossless);
  3. the proposer and the adaptive K controller learn the outcome;
  4. look-ahead (proposers that draft concurrently, i.e. the draft-model worker): while the device verifies step t,
     the proposer already drafts step t + 1 from the optimistic outcome "every draft accepted and the bonus token
     equals the proposer's own next guess". A proposal made ahead is used whenever the context it assumed came true
     and its first drafts match the tokens emitted since (those are cut off, the rest are the drafts). On a miss
     the request drafts nothing this step and a fresh proposal starts at once for the next one, so the device
     waits at most once per step for drafting (for a look-ahead still running), never twice.

Scheduling ahead (`draft_ahead`, `lookahead_ahead`), the next plan is scheduled while the previous one still
verifies its drafts, so its drafts are proposed past that plan's outcome, taken as every draft accepted plus the
proposer's own guess of the token after them: a proposal's first tokens stand for that outcome and the rest are
the drafts. The engine keeps them when the outcome is the one they assumed (`draft_ahead` returns it per request)
and drops them otherwise. Cheap proposers (n-gram, suffix) propose there and then, from the request's confirmed
tokens only, so they never learn a draft that is rejected later; a proposer that drafts concurrently (the draft
model) was started right after the previous launch (`lookahead_ahead`) and is waited for until a deadline.
Where the forward runs on the host's own cores (a CPU device), a cheap proposer drafts after the outcome instead,
between sampling and the launch (`draft_ahead(shared_cores=True)`, then `redraft`), as the synchronous step does:
a proposal beside that forward slows it by about its own time, and at batch 1 on copy tasks ~60 % of the
optimistic ones were dropped (measured in docs/benchmarks.md, 2026-12-07, stop 66).

`NoSpeculation` is the same interface doing nothing: the engine's step never asks whether speculation is on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tandem.request import Request
from tandem.spec_decode.adaptive import AdaptiveK
from tandem.spec_decode.ahead_policy import AheadChoice, AheadPolicy
from tandem.spec_decode.config import SpeculativeConfig
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer

logger = logging.getLogger("tandem")
PROPOSE_CHUNK = 16  # a cheap proposer is asked this many requests at a time, the deadline checked between chunks
CATCH_UP_TOKENS = 4  # a proposal that feeds a request more new tokens than this is not timed (ahead policy)
PROMPT_CATCH_UP_TOKENS = 64  # a cheap proposer fed this many new tokens (a prompt) works long enough to slow a forward
MaxDrafts = Callable[[Request], int]  # drafts a request may take this step (max_tokens / max_model_len room)


@dataclass
class SpecStats:
    """Speculation counters (cumulative)."""

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_rows: int = 0  # requests verified with at least one draft
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_wait_s: float = 0.0  # drafting the device waited for (before launch)
    lookahead_s: float = 0.0  # drafting hidden behind the forward
    lookahead_hits: int = 0
    lookahead_misses: int = 0
    draft_errors: int = 0  # requests whose drafting failed (they went on without drafts)
    ahead_drafted: int = 0  # scheduling ahead: requests given drafts past the outcome of the plan in flight
    optimistic_misses: int = 0  # ... whose drafts were dropped: that outcome was not the one they assumed
    redrafted: int = 0  # ... that were drafted again from the real outcome, before the launch
    ahead_late: int = 0  # ... left without drafts: the concurrent drafter had not answered by the deadline
    parked: int = 0  # alternating groups: request-steps that sat a plan out while they were drafted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified request-step: accepted drafts + the one the target adds."""
        return (self.num_accepted + self.num_verify_rows) / self.num_verify_rows if self.num_verify_rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        per_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {
            "spec_num_drafts": self.num_verify_rows,  # vLLM's num_drafts: request-steps that verified drafts
            "spec_num_drafted": self.num_drafted,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 3),
            "spec_acceptance_per_position": [round(x, 3) for x in per_pos],
            "spec_draft_wait_s": round(self.draft_wait_s, 4),
            "spec_lookahead_s": round(self.lookahead_s, 4),
            "spec_lookahead_hits": self.lookahead_hits,
            "spec_lookahead_misses": self.lookahead_misses,
            "spec_draft_errors": self.draft_errors,
            "spec_ahead_drafted": self.ahead_drafted,
            "spec_optimistic_misses": self.optimistic_misses,
            "spec_redrafted": self.redrafted,
            "spec_ahead_late": self.ahead_late,
            "spec_parked": self.parked,
        }


class Speculation(ABC):
    """The engine's speculation seam: draft before the step, look ahead during it, learn after it."""

    active = True  # drafts may be proposed (the engine then cannot schedule a step before the previous one sampled)

    @abstractmethod
    def draft(self, running: Sequence[Request], allowed: MaxDrafts) -> None:
        """Set `draft_token_ids` of the running requests in steady decode (before the step is scheduled)."""

    @abstractmethod
    def start_lookahead(self, scheduled: Sequence[Request]) -> None:
        """While the device verifies: start drafting the next step of the requests verifying drafts now."""

    @abstractmethod
    def draft_ahead(self, running: Sequence[Request], allowed: MaxDrafts, deadline: float | None,
                    shared_cores: bool = False) -> frozenset[str]:
        """Scheduling ahead: set `draft_token_ids` of the running requests in steady decode for the plan after the
        one in flight; a request of that plan is drafted past its outcome (see the module doc), and `still_valid`
        later says whether that outcome came. Returns the requests to leave out of the next plan (alternating
        groups: those in flight, drafted once their outcome is known). `deadline` (perf_counter): how long to
        wait for a concurrent drafter whose proposal was not sized to the step (None: until it answers).
        `shared_cores`: the forward runs on the host's cores; then (unless `draft_past_outcome` says otherwise) a
        cheap proposer proposes nothing here: K is chosen, and `redraft` drafts the step's requests, from their
        real outcome, before the launch (`drafts_after_outcome`)."""

    @property
    def drafts_after_outcome(self) -> bool:
        """The last `draft_ahead` left its step's drafts to `redraft`, after the outcome (they are the step's
        drafts, not a miss's repair)."""
        return False

    @abstractmethod
    def still_valid(self, tokens: Mapping[str, Sequence[int]]) -> set[str]:
        """The requests whose drafts of the last `draft_ahead` assumed the outcome `tokens` now gives them."""

    @abstractmethod
    def lookahead_ahead(self, launched: Sequence[Request], parked: Sequence[Request]) -> None:
        """Scheduling ahead, right after a launch: start a concurrent drafter on the requests the next plan will
        verify: those of the launched plan (past their tentative tails) or, with alternating groups, the `parked`
        ones (from their real outcome). The next `draft_ahead` picks the proposals up."""

    @abstractmethod
    def redraft(self, requests: Sequence[Request], allowed: MaxDrafts) -> dict[str, list[int]]:
        """Scheduling ahead, after an optimistic miss: drafts from the request's confirmed tokens, now (a cheap
        proposer only; {} otherwise)."""

    @property
    def drafts_cheaply(self) -> bool:
        """Drafting is cheap enough to run between a forward's end and the next launch (not a draft model)."""
        return False

    def missed(self, num: int) -> None:  # noqa: B027 - counted only where something drafts
        """`num` requests' drafts made ahead were dropped: the outcome they assumed did not happen."""

    @abstractmethod
    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        """Learn one verification of `drafts` that emitted `emitted`; returns how many drafts were accepted."""

    @abstractmethod
    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float, shared_cores: bool = False) -> None:
        """Learn one step's cost: tokens run, forward seconds, seconds the device waited for drafting;
        `shared_cores`: the forward ran on the host's cores beside the drafting of the next plan (scheduled ahead)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The request ended: drop its drafting state."""

    @abstractmethod
    def tidy(self, deadline: float | None) -> None:
        """The proposer's deferred work (`Proposer.tidy`) while the engine would wait: until `deadline` (perf_counter;
        None: all of it)."""

    @abstractmethod
    def stats_dict(self) -> dict[str, Any]:
        """Counters for `LLMEngine.get_stats` (empty when off)."""

    def close(self) -> None:  # noqa: B027 - only a proposer with workers has something to stop
        """Stop the proposer's workers."""


class NoSpeculation(Speculation):
    """Speculation off: no drafts, nothing to learn."""

    active = False

    def draft(self, running: Sequence[Request], allowed: MaxDrafts) -> None:
        pass

    def start_lookahead(self, scheduled: Sequence[Request]) -> None:
        pass

    def draft_ahead(self, running: Sequence[Request], allowed: MaxDrafts, deadline: float | None,
                    shared_cores: bool = False) -> frozenset[str]:
        return frozenset()

    def still_valid(self, tokens: Mapping[str, Sequence[int]]) -> set[str]:
        return set()

    def lookahead_ahead(self, launched: Sequence[Request], parked: Sequence[Request]) -> None:
        pass

    def redraft(self, requests: Sequence[Request], allowed: MaxDrafts) -> dict[str, list[int]]:
        return {}

    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        return 0

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float, shared_cores: bool = False) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def tidy(self, deadline: float | None) -> None:
        pass

    def stats_dict(self) -> dict[str, Any]:
        return {}


@dataclass
class _Ahead:
    """Drafts proposed ahead of time for one request: `future` continues `token_ids[:base] + assumed`."""

    base: int  # len(token_ids) when the proposal was started
    assumed: list[int]  # the tokens it assumed would follow (drafts + guess); [] for a proposal on the context then
    future: Future[dict[str, Drafts]]
    catch_up: bool = False  # it feeds the drafter many tokens it had not seen (a new request, or after a pause)


class SpeculativeDecoder(Speculation):
    """Owns the proposer, the K policy and the look-ahead state; CPU side only (no tensors)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k_max = config.num_speculative_tokens
        # a proposer that drafts concurrently (a draft model) shares the host's cores with the target's forward:
        # its true cost only shows in wall time, so adaptive K also measures goodput with and without speculation
        guard = 16 if proposer.drafts_concurrently else 0
        self.adaptive = AdaptiveK(self.k_max, guard_window=guard) if config.adaptive else None
        self.stats = SpecStats(accepted_per_position=[0] * self.k_max, drafted_per_position=[0] * self.k_max)
        self.lookahead = config.lookahead and proposer.drafts_concurrently
        self._guess: dict[str, int] = {}  # request -> the proposer's guess of the token after its drafts
        self._ahead: dict[str, _Ahead] = {}
        # scheduling ahead with a concurrent drafter: K and alternating groups per batch size, by measurement
        self.policy = AheadPolicy(self.k_max, config.alternate_groups) if proposer.drafts_concurrently else None
        self._choice = AheadChoice(self.k_max, False, 0.0)
        self._expected: dict[str, list[int]] = {}  # request -> the outcome its drafts of the next plan assume
        self._drafted: dict[str, int] = {}  # request -> the context length of its last proposal
        self._drafter_free_at = 0.0  # when the concurrent drafter's last proposal ended
        self._chosen_at, self._chosen_for = 0.0, 0  # when the ahead policy last chose, and for how many requests
        self._emitted = 0  # tokens emitted since
        self._waited_catch_up = False  # ... and whether a catch-up proposal was waited for meanwhile
        self._pending: tuple[int, AheadChoice, float] | None = None  # the last period's (batch, choice, seconds)
        self._step = 0  # draft_ahead calls
        # the last draft_ahead's K per request and its decode batch: a redraft of the same plan drafts as it chose
        self._step_k: dict[str, int] = {}
        self._step_batch = 0
        self._asked: dict[str, int] = {}  # request -> the step a cheap proposer was last asked for it
        self._empty: dict[str, int] = {}  # request -> its consecutive empty proposals
        self._past_drafts: dict[str, tuple[list[int], int]] = {}  # request -> (its drafts, the guess after them)
        # scheduling ahead, a cheap proposer caught up on many tokens (a new request's prompt) beside the forward
        # in flight: on a forward sharing the host's cores that slowed it (a first 5-token verify measured 35 ms,
        # 17 ms after), so its time does not teach adaptive K the cost of its size
        self._caught_up = False
        # the requests the last `draft_ahead` left to `redraft`, after the outcome (None: it proposed them itself)
        self._after_outcome: set[str] | None = None

    # ------------------------------------------------------------------------------------------------ drafting
    def draft(self, running: Sequence[Request], allowed: MaxDrafts) -> None:
        """Set `draft_token_ids` of every running request in steady decode. `allowed(req)` caps K for that request."""
        t0 = time.perf_counter()
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and not r.is_finished]
        batch: list[DraftRequest] = []
        restart: list[DraftRequest] = []
        ks: dict[str, int] = {}
        for req, chosen in zip(decoding, self._choose_ks([r.request_id for r in decoding], len(decoding)), strict=True):
            rid = req.request_id
            k = ks[rid] = min(chosen, allowed(req))
            ahead = self._ahead.pop(rid, None)
            req.draft_token_ids = []
            if k <= 0:
                continue
            if ahead is not None:
                usable = self._still_usable(req, ahead)
                if usable:
                    self.stats.lookahead_hits += 1
                    self._set(req, usable, k)
                    continue
                self.stats.lookahead_misses += 1
                restart.append(DraftRequest(rid, req.token_ids, req.num_prompt_tokens, self.k_max + 1))
                continue  # no drafts this step: the device does not wait a second time
            batch.append(DraftRequest(rid, req.token_ids, req.num_prompt_tokens, k + 1))
        if batch:
            proposals = self._propose(batch)
            by_id = {r.request_id: r for r in decoding}
            for dr in batch:
                self._set(by_id[dr.request_id], proposals.get(dr.request_id, Drafts([])).token_ids, ks[dr.request_id])
        if restart:
            self._propose_ahead(restart, {dr.request_id: [] for dr in restart})
        self.stats.draft_wait_s += time.perf_counter() - t0

    def _still_usable(self, req: Request, ahead: _Ahead) -> list[int] | None:
        """What a proposal made ahead still offers: its drafts after the tokens emitted since, when the context it
        assumed came true and its first drafts match those tokens; None otherwise (without waiting for it)."""
        tokens, end = req.token_ids, ahead.base + len(ahead.assumed)
        if len(tokens) < end or list(tokens[ahead.base : end]) != ahead.assumed:
            return None
        drafts = ahead.future.result().get(req.request_id)
        proposal = drafts.token_ids if drafts is not None else []
        emitted = list(tokens[end:])
        if proposal[: len(emitted)] != emitted:
            return None
        return proposal[len(emitted) :] or None

    def _propose(self, batch: list[DraftRequest]) -> dict[str, Drafts]:
        """The proposer's drafts; when it fails, each request is retried alone and the ones that still fail go on
        without drafts (drafting only ever speeds a request up: its output does not depend on it)."""
        try:
            return self.proposer.propose(batch)
        except Exception:  # noqa: BLE001 - one request's drafting must not stop the engine
            logger.exception("drafting failed for a batch of %d; retrying request by request", len(batch))
        out: dict[str, Drafts] = {}
        for dr in batch:
            try:
                out.update(self.proposer.propose([dr]))
            except Exception as e:  # noqa: BLE001
                self.stats.draft_errors += 1
                logger.warning("request %s: drafting failed (%s: %s); it continues without drafts", dr.request_id,
                               type(e).__name__, e)
                with contextlib.suppress(Exception):
                    self.proposer.release(dr.request_id)
        return out

    def _choose_k(self, rid: str, batch_size: int) -> int:
        return self.adaptive.choose(rid, batch_size) if self.adaptive is not None else self.k_max

    def _choose_ks(self, request_ids: list[str], batch_size: int) -> list[int]:
        """`_choose_k` of each of `request_ids`, in order (adaptive K's in one pass)."""
        if self.adaptive is not None:
            return self.adaptive.choose_many(request_ids, batch_size)
        return [self.k_max] * len(request_ids)

    def _set(self, req: Request, tokens: list[int], k: int) -> None:
        """Schedule the first k proposed tokens; keep the next one as the guess of the bonus token."""
        req.draft_token_ids = list(tokens[:k])
        if len(tokens) > k and req.draft_token_ids:
            self._guess[req.request_id] = tokens[k]
        else:
            self._guess.pop(req.request_id, None)

    def start_lookahead(self, scheduled: Sequence[Request]) -> None:
        """While the device verifies: draft the next step of each request from its optimistic outcome."""
        if not self.lookahead:
            return
        t0 = time.perf_counter()
        batch: list[DraftRequest] = []
        assumed: dict[str, list[int]] = {}
        for req in scheduled:
            guess = self._guess.get(req.request_id)
            if not req.draft_token_ids or guess is None:
                continue
            optimistic = req.token_ids + req.draft_token_ids + [guess]
            if len(optimistic) + self.k_max + 1 >= self.max_model_len:
                continue
            batch.append(DraftRequest(req.request_id, optimistic, req.num_prompt_tokens, self.k_max + 1))
            assumed[req.request_id] = [*req.draft_token_ids, guess]
        if batch:
            self._propose_ahead(batch, assumed)
        self.stats.lookahead_s += time.perf_counter() - t0

    def _propose_ahead(self, batch: list[DraftRequest], assumed: dict[str, list[int]], timed: int = 0) -> None:
        """Start one proposal for `batch` (each request's tokens + `assumed[rid]`) and remember it per request;
        `timed` (its draft steps): the ahead policy learns how long the drafter took."""
        started = time.perf_counter()
        # a proposal that catches the drafter up on many tokens (a request's first, or the first after a pause)
        # is not its speed
        behind = max(len(dr.token_ids) - self._drafted.get(dr.request_id, 0) for dr in batch)
        future = self.proposer.propose_async(batch)
        # every request of a proposal that catches one up waits as that one does: they share its answer (waiting
        # for a request's drafts without a deadline behind another's catch-up stalled 8-concurrent steps 176-400 ms)
        catch_up = behind > CATCH_UP_TOKENS
        for dr in batch:
            a = assumed[dr.request_id]
            self._ahead[dr.request_id] = _Ahead(len(dr.token_ids) - len(a), a, future, catch_up)
            self._drafted[dr.request_id] = len(dr.token_ids)
        if timed and self.policy is not None:
            future.add_done_callback(lambda _: self._drafter_answered(started, len(batch), timed, behind))

    def _drafter_answered(self, submitted: float, batch: int, steps: int, behind: int) -> None:
        """(The drafting thread, a proposal done.) The drafter ran it from when it was submitted or the previous
        one ended, whichever came later: that is its time, unless it had many tokens to catch up on."""
        now = time.perf_counter()
        started, self._drafter_free_at = max(submitted, self._drafter_free_at), now
        if self.policy is not None and behind <= CATCH_UP_TOKENS:
            self.policy.observe_proposal(batch, steps, now - started)

    # -------------------------------------------------------------------------------------- scheduling ahead
    @property
    def drafts_cheaply(self) -> bool:
        return not self.proposer.drafts_concurrently

    def draft_ahead(self, running: Sequence[Request], allowed: MaxDrafts, deadline: float | None,
                    shared_cores: bool = False) -> frozenset[str]:
        t0 = time.perf_counter()
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and not r.is_finished]
        self._expected = {}
        parked = self._parked(decoding)
        ks: dict[str, int] = {}
        fresh: list[DraftRequest] = []
        self._step += 1
        for req in decoding:
            req.draft_token_ids = []
        live = [req for req in decoding if req.request_id not in parked]
        cheap = not self.proposer.drafts_concurrently
        past = self.config.draft_past_outcome
        after = cheap and (not past if past is not None else shared_cores)
        self._after_outcome = set() if after else None
        for req, chosen in zip(live, self._ahead_ks([req.request_id for req in live], len(decoding)), strict=True):
            k = ks[req.request_id] = min(chosen, allowed(req))
            if k <= 0 or not cheap or not self._due(req.request_id):
                continue
            if self._after_outcome is not None:  # left to `redraft`, once the outcome is known
                self._after_outcome.add(req.request_id)
                continue
            # propose now, past the confirmed tokens and the tentative drafts (a guess first, then k drafts)
            tail = req.token_ids[len(req.token_ids) - req.num_tentative : len(req.token_ids) - 1]
            fresh.append(DraftRequest(req.request_id, req.confirmed_tokens, req.num_prompt_tokens,
                                      k + (1 if req.num_tentative else 0), tail))
        self._step_k, self._step_batch = ks, len(decoding)
        if fresh:
            self._propose_now(fresh, deadline)
        # a concurrent drafter's proposal sized to the step is waited for (the policy counted the wait); one still
        # catching up on many tokens (as slow as the prompt is long) only when nobody else waits behind it or when
        # the policy probes (its drafts must be verified for the acceptance to be measured at all)
        sized = self.policy is not None and self._choice.k > 0
        catch_up = None if sized and (self._choice.probe or len(decoding) == 1) else deadline
        for req in decoding:
            if ks.get(req.request_id, 0) > 0:
                self._take_ahead(req, ks[req.request_id], None if sized else deadline, catch_up)
        self.stats.ahead_drafted += len(self._expected)
        self.stats.parked += len(parked)
        self.stats.lookahead_s += time.perf_counter() - t0  # during the forward in flight
        return parked

    @property
    def drafts_after_outcome(self) -> bool:
        return self._after_outcome is not None

    def _due(self, rid: str) -> bool:
        """A request whose last proposals came back empty is asked again less often (every 2nd, 4th, ... up to
        every 16th step): most of a large batch of chat requests has nothing for a suffix tree or an n-gram to
        match most of the time, and asking each of them every step was most of the host's work per step."""
        empty = self._empty.get(rid, 0)
        return empty < 2 or self._step % (1 << min(4, empty - 1)) == 0

    def _propose_now(self, batch: list[DraftRequest], deadline: float | None) -> None:
        """A cheap proposer's drafts for `batch`, in chunks while `deadline` has not passed: those asked longest
        ago go first, the rest wait for a later step (the host's other work of the step must fit the forward)."""
        batch.sort(key=lambda dr: self._asked.get(dr.request_id, 0))
        for i in range(0, len(batch), PROPOSE_CHUNK):
            if deadline is not None and i and time.perf_counter() >= deadline:
                break
            chunk = batch[i : i + PROPOSE_CHUNK]
            for dr in chunk:
                self._caught_up |= len(dr.token_ids) - self._drafted.get(dr.request_id, 0) > PROMPT_CATCH_UP_TOKENS
                self._drafted[dr.request_id] = len(dr.token_ids)
            future: Future[dict[str, Drafts]] = Future()
            future.set_result(self._propose(chunk))
            for dr in chunk:
                self._ahead[dr.request_id] = _Ahead(len(dr.token_ids), list(dr.assumed), future)
            self._count_asked(chunk, future.result())

    def _count_asked(self, batch: list[DraftRequest], proposals: Mapping[str, Drafts]) -> None:
        """`batch` was asked this step; its requests that got nothing are asked less often (`_due`)."""
        for dr in batch:
            self._asked[dr.request_id] = self._step
            got = proposals.get(dr.request_id)
            self._empty[dr.request_id] = 0 if got is not None and got.token_ids else self._empty.get(dr.request_id, 0) + 1

    def _parked(self, decoding: Sequence[Request]) -> frozenset[str]:
        """Alternating groups (a concurrent drafter, when the policy prefers them): the requests in flight sit
        out the next plan while they are drafted; when every decoding request is in flight, every other one does
        (the groups form)."""
        if self.policy is None:
            return frozenset()
        now = time.perf_counter()
        # a step's choice is measured by its period (the time from its choice to the next, which holds the wait for
        # its drafts) and the tokens its plan emitted. Scheduled ahead, those tokens land one period later: crediting
        # a period with the tokens that arrived in it gave the first period after a change the previous choice's
        # tokens (measured, 8 concurrent with a draft model: K = 2's first periods got 8 tokens each, K = 0's first
        # 24), which kept drafting off for the rest of the run although K = 1 gave 569 tok/s against 427 off. Not
        # measured: a period that waited for the drafter catching up on a new request's prompt (the request's
        # arrival, not the choice's cost).
        if self._pending is not None:
            batch, choice, seconds = self._pending
            self.policy.observe_period(batch, choice, seconds, self._emitted)
        if not decoding:  # every request prefills (or none runs): no choice to make, no period to measure from here
            self._pending, self._chosen_at, self._waited_catch_up = None, 0.0, False
            return frozenset()
        waited = self._waited_catch_up
        self._pending = None if not self._chosen_at or waited else (self._chosen_for, self._choice, now - self._chosen_at)
        self._waited_catch_up = False
        self._choice, self._chosen_for, self._chosen_at = self.policy.choose(len(decoding)), len(decoding), now
        self._emitted = 0
        if not self._choice.alternate:
            return frozenset()
        in_flight = [r.request_id for r in decoding if r.num_tentative]
        return frozenset(in_flight if len(in_flight) < len(decoding) else in_flight[::2])

    def _ahead_ks(self, request_ids: list[str], batch: int) -> list[int]:
        """K for each of `request_ids` this step, in order (the policy's, or adaptive K's per request)."""
        return [self._choice.k] * len(request_ids) if self.policy is not None else self._choose_ks(request_ids, batch)

    def _take_ahead(self, req: Request, k: int, deadline: float | None, catch_up_deadline: float | None) -> None:
        """Drafts for `req` from its proposal made ahead, when that one still fits what is known and tentative;
        waited for until `deadline` (`catch_up_deadline` for a proposal catching the drafter up)."""
        ahead = self._ahead.pop(req.request_id, None)
        if ahead is None:
            return
        if ahead.catch_up:
            deadline = catch_up_deadline
            self._waited_catch_up |= not ahead.future.done()
        if not ahead.future.done():
            wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                ahead.future.result(timeout=wait)
            except futures.TimeoutError:
                self.stats.ahead_late += 1
                self._ahead[req.request_id] = ahead  # may still serve a later step
                return
        past = self._past(req, ahead)
        if past is None:
            return
        guess, rest = past
        drafts = rest[:k]
        if not drafts:
            return
        req.draft_token_ids = drafts
        if len(rest) > len(drafts):  # the proposal's guess of the token after these drafts
            self._past_drafts[req.request_id] = ([*drafts], rest[len(drafts)])
        if guess is not None:
            tail = req.token_ids[len(req.token_ids) - req.num_tentative : len(req.token_ids) - 1]
            self._expected[req.request_id] = [*tail, guess]

    @staticmethod
    def _past(req: Request, ahead: _Ahead) -> tuple[int | None, list[int]] | None:
        """What a proposal made ahead offers past the request's known and tentative tokens (its placeholder
        excluded): (the guess of the token its plan in flight samples, or None when none is in flight; the tokens
        after it), or None when the proposal's context and the request's tokens part.

        The proposal's context may end past those tokens by one guessed token (proposed from drafts and the guess
        of the previous step), or short of them (its first tokens must then be the ones since)."""
        tokens = req.token_ids
        known = len(tokens) - (1 if req.num_tentative else 0)  # up to the placeholder
        context = list(tokens[ahead.base : known])  # what the request holds past the proposal's base
        assumed = ahead.assumed
        drafts = ahead.future.result().get(req.request_id)
        proposal = drafts.token_ids if drafts is not None else []
        in_flight = req.num_tentative > 0
        if len(assumed) > len(context):  # the proposal assumed the placeholder's token too
            if not in_flight or len(assumed) != len(context) + 1 or assumed[: len(context)] != context:
                return None
            return assumed[-1], proposal
        if context[: len(assumed)] != assumed:
            return None
        seen = context[len(assumed) :]
        if proposal[: len(seen)] != seen:
            return None
        rest = proposal[len(seen) :]
        if not in_flight:
            return None, rest
        return (rest[0], rest[1:]) if rest else None

    def still_valid(self, tokens: Mapping[str, Sequence[int]]) -> set[str]:
        keep = set()
        for rid, want in self._expected.items():
            got = tokens.get(rid)
            if got is not None and list(got) == want:
                keep.add(rid)
            if self.policy is not None and got is not None and len(got) == len(want):  # every draft accepted
                self.policy.observe_outcome(0, 0, got[-1] == want[-1])
        return keep

    def lookahead_ahead(self, launched: Sequence[Request], parked: Sequence[Request]) -> None:
        if not (self.lookahead and self.proposer.drafts_concurrently) or self._choice.k <= 0:
            return
        t0 = time.perf_counter()
        targets = parked if self._choice.alternate else launched
        batch, assumed = [], {}
        n = self._choice.k + (0 if self._choice.alternate else 1)  # optimistic: the guess first
        for req in targets:
            if req.is_finished or req.num_tokens + n + 1 >= self.max_model_len:
                continue
            pending = self._ahead.get(req.request_id)
            if pending is not None and not pending.future.done():
                continue  # one proposal at a time: a queue behind a slow one would only grow
            tentative = req.num_tentative
            context = req.token_ids[: len(req.token_ids) - 1] if tentative else list(req.token_ids)
            drafts, guess = self._past_drafts.pop(req.request_id, ([], -1))
            if tentative > 1 and drafts == context[len(context) - (tentative - 1) :]:
                context.append(guess)  # the proposal that gave its drafts guessed the token after them
            base = len(req.token_ids) - tentative
            batch.append(DraftRequest(req.request_id, context, req.num_prompt_tokens, n))
            assumed[req.request_id] = context[base:]
        if batch:
            self._propose_ahead(batch, assumed, timed=n)
        self.stats.lookahead_s += time.perf_counter() - t0

    def redraft(self, requests: Sequence[Request], allowed: MaxDrafts) -> dict[str, list[int]]:
        if self.proposer.drafts_concurrently or not requests:
            return {}
        t0 = time.perf_counter()
        due = self._after_outcome  # drafting after the outcome: those due, and those draft_ahead did not see
        batch = [DraftRequest(r.request_id, r.confirmed_tokens, r.num_prompt_tokens, min(self._redraft_k(r), allowed(r)))
                 for r in requests if due is None or r.request_id in due or r.request_id not in self._step_k]
        wanted = [dr for dr in batch if dr.max_drafts > 0]
        proposals = self._propose(wanted) if wanted else {}
        if due is not None:  # these are the step's drafts, not a miss's repair: asked this step
            self._count_asked(wanted, proposals)
        out = {rid: d.token_ids for rid, d in proposals.items() if d.token_ids}
        self.stats.redrafted += len(out)
        self.stats.draft_wait_s += time.perf_counter() - t0
        return out

    def _redraft_k(self, req: Request) -> int:
        """K for a request drafted again for the plan the last `draft_ahead` drafted: the K chosen there, for the
        whole decode batch. (Chosen again for the few redrafted at a time, adaptive K priced a step as if only
        they were in it: the demo model, 32 chat requests on two cores scheduled ahead, chose K = 4-8 for most
        redrafts against K = 0-1 synchronously, verifying 43 % more drafts for 30 % more accepted.)"""
        k = self._step_k.get(req.request_id)
        return k if k is not None else self._choose_k(req.request_id, max(self._step_batch, 1))

    def missed(self, num: int) -> None:
        self.stats.optimistic_misses += num

    # ------------------------------------------------------------------------------------------------ learning
    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        """Learn one verification; returns how many drafts were accepted."""
        k = len(drafts)
        accepted = 0
        while accepted < min(k, len(emitted) - 1) and emitted[accepted] == drafts[accepted]:
            accepted += 1
        if self.adaptive is not None:
            self.adaptive.observe_emitted(len(emitted))
        self._emitted += len(emitted)
        if self.policy is not None and k:
            self.policy.observe_outcome(k, accepted, None)
        if k:
            s = self.stats
            s.num_drafted += k
            s.num_accepted += accepted
            s.num_verify_rows += 1
            for i in range(k):
                s.drafted_per_position[i] += 1
                if i < accepted:
                    s.accepted_per_position[i] += 1
            if self.adaptive is not None:
                self.adaptive.observe_acceptance(req.request_id, k, accepted)
        self.proposer.on_verified(req.request_id, list(drafts[:accepted]), k)
        self._guess.pop(req.request_id, None)
        return accepted

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float, shared_cores: bool = False) -> None:
        self.stats.num_steps += 1
        if self.policy is not None:
            self.policy.observe_forward(seconds)
        if self.adaptive is not None:  # (0 tokens: the step counts, its time teaches no size's cost)
            self.adaptive.observe_step(0 if self._caught_up and shared_cores else num_tokens, seconds, draft_seconds)
        self._caught_up = False

    def release(self, request_id: str) -> None:
        self._drafted.pop(request_id, None)
        self._asked.pop(request_id, None)
        self._empty.pop(request_id, None)
        self._past_drafts.pop(request_id, None)
        self._expected.pop(request_id, None)
        self.proposer.release(request_id)
        if self.adaptive is not None:
            self.adaptive.release(request_id)
        self._guess.pop(request_id, None)
        self._ahead.pop(request_id, None)

    def tidy(self, deadline: float | None) -> None:
        self.proposer.tidy(deadline)

    def stats_dict(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def close(self) -> None:
        self.proposer.close()


def make_speculation(config: SpeculativeConfig | None, proposer: Proposer | None, max_model_len: int) -> Speculation:
    """`SpeculativeDecoder` over `proposer` when a config is given, else `NoSpeculation`."""
    if config is None:
        return NoSpeculation()
    if proposer is None:
        raise ValueError("speculation needs a proposer")
    return SpeculativeDecoder(config, proposer, max_model_len)
