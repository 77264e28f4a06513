"""Structured outputs inside the engine: compile on arrival, hold sampling until ready, fill masks during the
forward, feed sampled tokens to the matchers, end requests when their grammar terminates.

All grammar state lives in `StructuredOutputManager` (host CPU, plain data). This module only maps the step plan's
logits rows to bitmask rows:
  * a plain request samples one row: one bitmask row;
  * a request verifying k drafts has k + 1 rows: row j is filled after the matcher has accepted drafts[:j],
    then the matcher rolls those k drafts back (the real outcome is accepted after verification).
Drafts of guided requests are cut at their first token the grammar rejects; tokens the grammar forces are
proposed as drafts (free: the mask makes the target put all its mass on them, so they are always accepted).

Unmasked greedy verification: a greedy request's drafts are verified without their k + 1 mask fills, and the tokens
it emits checked afterwards with one validation (`check_unmasked_verify`); a request they fail is verified again with
its masks, before the tokens count.

Unmasked greedy rows: a greedy request in a state of free text (e.g. inside a JSON string) gets no mask fill for
its next row: it is sampled unconstrained and its token checked afterwards (`check_unmasked`). Free text is told
by a probe, validations of the tokens "q" and "X" on the fill thread instead of the fill (or by the request's last mask:
open and costly). When the grammar accepts the argmax, that token is the masked argmax too (same logits, a subset of
the candidates, ties to the lowest id), so outputs are exactly those of masked sampling; when it rejects it, the
engine takes the first allowed of the row's top candidates, or fills the mask and samples again (scheduling ahead,
during the next forward, which that request sits out). Free-text fills are the expensive ones (0.3-2 ms each over a
200k vocabulary, against ~0.04 ms in structural states): 1 % of the rows held a third of the fill CPU time.
Scheduling ahead beside an accelerator, such rows are filled all the same while the forward leaves time for them
(`start_fill`'s deadline, structured/slack_fill.py): a row filled so is masked, and its check leaves the device's
critical path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.core.plan import StepPlan
from tandem.params import EngineOverloaded, ParamError, SamplingParams, StructuredOutputsParams
from tandem.request import Request
from tandem.structured.backend import GrammarError, GrammarQueueFull, bitmask_words
from tandem.structured.manager import PendingFill, Slack, StructuredOutputConfig, StructuredOutputManager

logger = logging.getLogger("tandem")
MAX_FORCED_DRAFTS = 16  # forced tokens proposed per step: a long forced run (a 30 KB const) goes in chunks


@dataclass
class _FillRows:
    """A plan's logits rows sorted for a fill (`Guidance._sort_rows`): sampled rows are numbered among the sampled
    rows, verify rows (k + 1 each) among the verify rows."""

    sampled_ids: list[str] = field(default_factory=list)  # filled in full (batched)
    sampled_rows: list[int] = field(default_factory=list)
    probe: dict[str, tuple[int, ...]] = field(default_factory=dict)  # of those, the ones probed first
    slack_ids: list[str] = field(default_factory=list)  # may skip their mask: filled in the forward's slack
    slack_rows: list[int] = field(default_factory=list)
    unmasked: list[str] = field(default_factory=list)  # may skip their mask, no slack: sampled unmasked
    verify_jobs: list[tuple[str, int, list[int]]] = field(default_factory=list)  # (request, first row, drafts)
    unmasked_verify: list[str] = field(default_factory=list)  # drafts verified without masks
    num_sampled: int = 0
    num_verify: int = 0


class PendingMasks:
    """A step's masks being filled (`Guidance.start_fill`); `result()` waits for them, once."""

    def __init__(self, guidance: Guidance, masks: StepMasks, pending: PendingFill | None, spent_s: float) -> None:
        self._guidance, self._masks, self._pending, self._spent_s = guidance, masks, pending, spent_s
        self._done = False

    def stop_slack(self) -> None:
        """No further slack row starts (the plan will not be sampled: waiting for them would only delay)."""
        if self._pending is not None:
            self._pending.stop_slack()

    def result(self) -> StepMasks:
        if not self._done:
            self._done = True
            self._masks = self._guidance._finish_fill(self._masks, self._pending, self._spent_s)
        return self._masks


@dataclass
class StepMasks:
    """Bitmasks for the rows sampled this step, in the step sampler's two row orders (None: no guided row there)."""

    sample_rows: np.ndarray | None  # [n_sampled_rows, W] int32: one row per request sampled directly
    verify_rows: np.ndarray | None  # [n_verify_rows, W] int32: k + 1 rows per request verifying k drafts
    fill_s: float = 0.0
    unmasked: list[str] = field(default_factory=list)  # guided requests sampled without a mask: check their tokens
    unmasked_verify: list[str] = field(default_factory=list)  # guided requests verifying drafts without masks: check
    # each one's emitted tokens (accepted drafts and the token after them) before they count

    @property
    def guided(self) -> bool:
        """Some row of this step is constrained by a grammar."""
        return self.sample_rows is not None or self.verify_rows is not None


@dataclass
class GuidanceStats:
    num_guided_tokens: int = 0
    num_forced_tokens: int = 0  # emitted tokens that the grammar forced (proposed as free drafts)
    mask_fill_s: float = 0.0
    exposed_s: float = 0.0  # mask work the device had to wait for (see `Guidance.record_wait`)
    num_unmasked_rows: int = 0  # greedy rows sampled without a mask fill, their token checked afterwards
    num_unmasked_verify: int = 0  # greedy requests that verified drafts without mask fills, checked afterwards
    num_verify_rejected: int = 0  # of those, requests whose emitted tokens the grammar rejected: verified again masked
    num_skips: int = 0  # of those, rows the fill left (probe passed, or not reached in the forward's slack)
    num_unmasked_rejected: int = 0  # of those, rows whose argmax the grammar rejected
    num_candidate_hits: int = 0  # rejected rows settled by a top candidate (no fill)
    num_refills: int = 0  # rejected rows that needed their mask after all
    num_slack_fills: int = 0  # rows that could have been left unmasked, filled while the forward ran

    def as_dict(self) -> dict[str, float]:
        frac = self.num_forced_tokens / self.num_guided_tokens if self.num_guided_tokens else 0.0
        return {
            "guided_unmasked_rows": self.num_unmasked_rows,
            "guided_unmasked_rejected": self.num_unmasked_rejected,
            "guided_unmasked_verify": self.num_unmasked_verify,
            "guided_verify_rejected": self.num_verify_rejected,
            "guided_skips": self.num_skips,
            "guided_slack_fills": self.num_slack_fills,
            "guided_candidate_hits": self.num_candidate_hits,
            "guided_refills": self.num_refills,
            "guided_tokens": self.num_guided_tokens,
            "guided_forced_tokens": self.num_forced_tokens,
            "guided_forced_fraction": round(frac, 4),
            "grammar_mask_fill_s": round(self.mask_fill_s, 4),
            "grammar_exposed_s": round(self.exposed_s, 4),
        }


class Guidance:
    """The engine's view of structured outputs; the manager is built on first use (tokenizer info once per engine).

    Fault isolation: an error from grammar work on one request (a matcher that fails to fill, accept, validate or
    roll back) is recorded in `failure(rid)`; the engine then ends that request alone with finish_reason "error".
    """

    def __init__(self, make_manager: Callable[[], StructuredOutputManager], vocab_size: int,
                 unmasked_greedy: bool = True, probe_tokens: tuple[int, ...] = (), eos: Sequence[int] = ()) -> None:
        """probe_tokens: plain letters' token ids; an argmax-only row whose grammar allows each of them next skips its
        fill (empty: only rows whose last fill was open and costly do). eos: the ids that end a grammar."""
        self._make_manager = make_manager
        self._eos = frozenset(eos)
        self.unmasked_greedy = unmasked_greedy
        self.probe_tokens = probe_tokens if unmasked_greedy else ()
        self._manager: StructuredOutputManager | None = None
        self._hold_compiles = False  # see `hold_compiles`
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.stats = GuidanceStats()
        self._pending: set[str] = set()
        self._ready: set[str] = set()
        self._thinking: set[str] = set()  # reasoning models: no mask and no advance until the thinking ends
        self._early: dict[str, list[int]] = {}  # answer tokens emitted before the grammar compiled (an implicit end)
        self._forced: dict[str, int] = {}  # request -> number of its scheduled drafts that are grammar-forced
        self._failed: dict[str, str] = {}  # request -> why its grammar work failed (it ends at the next advance)
        self._argmax_only: set[str] = set()  # greedy requests with nothing else changing their logits
        self._recheck: set[str] = set()  # their argmax was rejected last time: fill the next mask
        self._refilled: set[str] = set()  # ... and no top candidate settled it: fill the next mask without a probe

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            self._manager = self._make_manager()
            if self._hold_compiles:
                self._manager.hold_compiles()
        return self._manager

    def hold_compiles(self) -> None:
        """New grammars compile once `start_compiles` is called, not at `submit` (which still refuses what it
        refused: `StructuredOutputManager.hold_compiles`)."""
        self._hold_compiles = True
        if self._manager is not None:
            self._manager.hold_compiles()

    def start_compiles(self) -> None:
        """Start the compiles held since the last call (none before the first guided request)."""
        if self._manager is not None:
            self._manager.start_compiles()

    def guided(self, request_id: str) -> bool:
        return request_id in self._ready or request_id in self._pending

    def is_ready(self, request_id: str) -> bool:
        return request_id in self._ready

    def through_end(self, request_id: str, tokens: list[int], answer_from: int = 0) -> list[int]:
        """`tokens` through the first EOS of the answer (from `answer_from`) when the request's grammar applies: an
        EOS there ends the grammar (its masks allow one only where it can end, and nothing but EOS after it), so
        with `ignore_eos` the tokens a step verified past it (drafts of EOS, or a row of the plan launched ahead)
        are not the request's."""
        if self._eos and self._active(request_id):
            for i in range(answer_from, len(tokens)):
                if tokens[i] in self._eos:
                    return tokens[: i + 1]
        return tokens

    def _active(self, request_id: str) -> bool:
        """Its grammar applies now: compiled, and not waiting for the thinking to end."""
        return request_id in self._ready and request_id not in self._thinking

    def defer(self, request_id: str) -> None:
        """The request thinks first: its grammar neither masks nor advances until `begin_answer`."""
        self._thinking.add(request_id)

    def deferred(self, request_id: str) -> bool:
        """Its grammar waits for the thinking to end (`defer`, not yet `begin_answer`)."""
        return request_id in self._thinking

    def begin_answer(self, request_id: str) -> None:
        """The thinking ended: the grammar starts at the next token (from its start state)."""
        self._thinking.discard(request_id)

    def failure(self, request_id: str) -> str | None:
        """Why the request's grammar failed during this step, or None."""
        return self._failed.get(request_id)

    @property
    def num_compiling(self) -> int:
        """Grammar compiles running now (0 before the first guided request)."""
        return self._manager.num_compiling if self._manager is not None else 0

    def _fail(self, request_id: str, reason: str) -> None:
        logger.warning("request %s: grammar failed: %s", request_id, reason)
        self._failed[request_id] = reason
        self._ready.discard(request_id)

    # ---------------------------------------------------------------------------------------------- arrival
    def submit(self, req: Request, params: StructuredOutputsParams) -> None:
        """Start compiling for `req` and hold its sampling until ready. ParamError for this request alone
        (EngineOverloaded when the compile queue is full)."""
        try:
            self.manager.submit(req.request_id, params)
        except GrammarQueueFull as e:
            raise EngineOverloaded(str(e)) from e
        except GrammarError as e:
            raise ParamError(str(e)) from e
        req.hold_sampling = True
        self._pending.add(req.request_id)
        if self.unmasked_greedy and _decided_by_argmax(req.params):
            self._argmax_only.add(req.request_id)

    def poll(self) -> tuple[list[tuple[str, str | None, str | None]], list[tuple[str, str]]]:
        """Lift the hold of requests whose grammar is ready; return (ready [(id, backend, why that backend)],
        failed [(id, reason)])."""
        ready: list[tuple[str, str | None, str | None]] = []
        failed: list[tuple[str, str]] = []
        m = self.manager
        for rid in list(self._pending):
            state = m.poll(rid)
            if state == "ready":
                self._pending.discard(rid)
                self._ready.add(rid)
                self._take_early(rid)
                ready.append((rid, m.backend_of(rid), m.reason_of(rid)))
            elif state == "failed":
                self._pending.discard(rid)
                failed.append((rid, m.error(rid) or "grammar compilation failed"))
        return ready, failed

    def _take_early(self, rid: str) -> None:
        """A thinking that ended before its grammar compiled, on tokens that are the answer's (Qwen3's `<tool_call>`):
        the grammar takes them now, if it allows them (else it starts after them, as in `accept`)."""
        early = self._early.pop(rid, None)
        if early:
            try:
                self.accept_unchecked(rid, early)
            except Exception as e:  # noqa: BLE001 - this request's grammar failed; it ends at its next advance
                self._fail(rid, f"{type(e).__name__}: {e}")

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # --------------------------------------------------------------------------------------------- drafting
    def constrain_drafts(self, running: Sequence[Request], max_drafts: Callable[[Request], int]) -> None:
        """Cut guided drafts at their first invalid token; without drafts, propose the grammar's forced tokens."""
        self._forced.clear()
        for req in running:
            if self._active(req.request_id) and req.num_computed_tokens == req.num_tokens - 1:
                try:
                    self._constrain(req, max_drafts)
                except Exception as e:  # noqa: BLE001 - this request's grammar failed; the others go on
                    req.draft_token_ids = []
                    self._fail(req.request_id, f"checking drafts failed: {type(e).__name__}: {e}")

    def _constrain(self, req: Request, max_drafts: Callable[[Request], int]) -> None:
        rid, m = req.request_id, self.manager
        if req.draft_token_ids:
            ok = m.validate_draft(rid, req.draft_token_ids)
            req.draft_token_ids = req.draft_token_ids[:ok]
        if not req.draft_token_ids:
            forced = m.forced_tokens(rid, min(MAX_FORCED_DRAFTS, max_drafts(req)))
            if forced:
                req.draft_token_ids = forced
                self._forced[rid] = len(forced)

    def drafts_were_forced(self, request_id: str) -> bool:
        """This step's drafts of the request came from the grammar, not from a proposer."""
        return request_id in self._forced

    # ------------------------------------------------------------------------------------------------ masks
    def fill(self, plan: StepPlan, alloc: Callable[[str, int, int], np.ndarray] | None = None) -> StepMasks:
        """Bitmasks for this step's sampled rows (call while the forward runs). Unguided rows allow everything;
        a request whose fill fails is recorded in `failure` (its rows are then irrelevant).

        `alloc(kind, rows, words)` gives the all-ones int32 arrays to fill ('sample' / 'verify'), e.g. views of
        page-locked memory for an accelerator; default: fresh arrays."""
        return self.start_fill(plan, alloc).result()

    def start_fill(self, plan: StepPlan, alloc: Callable[[str, int, int], np.ndarray] | None = None,
                   deadline: float | None = None, forward: Future[Any] | None = None) -> PendingMasks:
        """`fill`, returning while llguidance's threads still fill the batched rows: the caller goes on with other
        work (no GIL is held by the fill meanwhile), and must not use the plan's matchers before `result()`.

        `deadline` (a `time.perf_counter()` instant before the forward is expected to end): the rows that may skip
        their mask are filled too while each is expected to finish by then and `forward` (the forward's future) is
        not done (`structured/slack_fill.py`); `result()` waits for them; those not reached are unmasked. None:
        they are unmasked."""
        alloc = alloc or _fresh
        t0 = time.perf_counter()
        rows = self._sort_rows(plan, slack=deadline is not None)
        sample_mask = verify_mask = None
        pending = None
        if rows.sampled_ids or rows.slack_ids:
            sample_mask = alloc("sample", rows.num_sampled, self.words)
            slack = Slack(rows.slack_ids, rows.slack_rows, deadline, forward) if deadline is not None else None
            pending = self.manager.start_fill(rows.sampled_ids, sample_mask, rows.sampled_rows, probe=rows.probe,
                                              slack=slack)
        if rows.verify_jobs:
            verify_mask = alloc("verify", rows.num_verify, self.words)
            for rid, row0, drafts in rows.verify_jobs:
                self._fill_verify_rows(rid, drafts, verify_mask, row0)
        self.stats.num_unmasked_verify += len(rows.unmasked_verify)
        masks = StepMasks(sample_mask, verify_mask, 0.0, rows.unmasked, rows.unmasked_verify)
        return PendingMasks(self, masks, pending, time.perf_counter() - t0)

    def _sort_rows(self, plan: StepPlan, slack: bool) -> _FillRows:
        """The plan's logits rows by how their masks are made; the rows filled in full leave `_recheck` (and
        `_refilled`). `slack`: the rows that may skip their mask are offered to the forward's slack instead of left
        unmasked. All need a greedy request with nothing else changing its logits (`_argmax_only`), whose argmax
        was not rejected last time (`_recheck`), and a backend whose validation takes exactly its masks' tokens:
        - drafts verified without masks (k + 1 fills one after another on this thread: 0.5 ms a request over the
          demo model's 49k tokens, 3.4 ms of a 20 ms step at 256 guided requests with suffix drafts, AMD EPYC), the
          emitted tokens checked after (`check_unmasked_verify`); not drafts the grammar forced, where the
          target's argmax may differ from the only allowed token, which its mask makes certain;
        - a sampled row skips its mask where the last one was open (free text: the model's own choice most likely
          allowed, a fill expensive);
        - a row filled in full is probed first (its top candidates checked) unless its last rejection needed the
          mask after all (`_refilled`): a top candidate settling a rejection costs little, a refill costs its
          request a step when scheduling ahead."""
        rows = _FillRows()
        # asked of every row each step (~0.9 ms at 256 rows as calls per test): the sets and traits looked up here
        ready, thinking, argmax_only, recheck, refilled, forced = (self._ready, self._thinking, self._argmax_only,
                                                                   self._recheck, self._refilled, self._forced)
        traits = self.manager.skip_traits  # (validates as masks, last mask open)
        for sr in plan.requests:
            rid = sr.request_id
            if not sr.needs_logits:
                continue
            guided = rid in ready and rid not in thinking
            k = sr.num_draft_tokens
            if k:
                if guided and rid in argmax_only and rid not in recheck and rid not in forced and traits(rid)[0]:
                    rows.unmasked_verify.append(rid)
                elif guided:
                    rows.verify_jobs.append((rid, rows.num_verify, sr.input_ids[-k:]))
                    recheck.discard(rid)
                rows.num_verify += k + 1
                continue
            as_masks, was_open = traits(rid) if guided and rid in argmax_only else (False, False)
            if as_masks and was_open and rid not in recheck:
                if slack:
                    rows.slack_ids.append(rid)
                    rows.slack_rows.append(rows.num_sampled)
                else:
                    rows.unmasked.append(rid)
            elif guided:
                rows.sampled_ids.append(rid)
                rows.sampled_rows.append(rows.num_sampled)
                if self.probe_tokens and as_masks and rid not in refilled:
                    rows.probe[rid] = self.probe_tokens
                recheck.discard(rid)
                refilled.discard(rid)
            rows.num_sampled += 1
        return rows

    def _finish_fill(self, masks: StepMasks, pending: PendingFill | None, spent_s: float) -> StepMasks:
        """Settle a started fill: failures recorded, skipped rows unmasked, stats (`spent_s`: the fill's time on
        the calling thread before; the wait for the batch is added)."""
        t0 = time.perf_counter()
        if pending is not None:
            failures, skipped = pending.result()
            for rid, reason in failures.items():
                self._fail(rid, reason)
            masks.unmasked.extend(skipped)
            self.stats.num_skips += len(skipped)
            self.stats.num_slack_fills += pending.num_slack_filled
        masks.fill_s = spent_s + time.perf_counter() - t0
        self.stats.mask_fill_s += masks.fill_s
        self.stats.num_unmasked_rows += len(masks.unmasked)
        return masks

    # ------------------------------------------------------------------------------------- unmasked greedy rows
    def check_unmasked(self, unmasked: Sequence[str], tokens: Mapping[str, Sequence[int]]) -> list[str]:
        """The requests among `unmasked` whose sampled token the grammar rejects (their next mask will be filled);
        a request whose check fails in the library is recorded in `failure`."""
        rejected = self._rejected(unmasked, tokens, first_only=True)
        self.stats.num_unmasked_rejected += len(rejected)
        return rejected

    def check_unmasked_verify(self, unmasked: Sequence[str], tokens: Mapping[str, Sequence[int]]) -> list[str]:
        """The requests among `unmasked` (drafts verified without masks) whose emitted tokens the grammar rejects.

        Why one validation suffices: greedy verification emits drafts[:m] while each equals its row's argmax, then
        row m's argmax. If the grammar allows all of those in turn, each was also its row's masked argmax (same
        logits, a subset of the candidates), so masked verification emits the same tokens. Otherwise the request is
        verified again with its masks (`verify_masks`) and its next rows are masked. A request whose check fails in
        the library is recorded in `failure`."""
        rejected = self._rejected(unmasked, tokens, first_only=False)
        self.stats.num_verify_rejected += len(rejected)
        return rejected

    def _rejected(self, unmasked: Sequence[str], tokens: Mapping[str, Sequence[int]], first_only: bool) -> list[str]:
        """The active requests among `unmasked` whose tokens (the first only, or all in turn) the grammar rejects;
        their next rows are masked. A library failure is recorded in `failure` (that request is left out)."""
        rejected: list[str] = []
        for rid in unmasked:
            toks = tokens.get(rid)
            if not self._active(rid) or not toks:
                continue
            checked = toks[:1] if first_only else toks
            try:
                ok = self.manager.validate_draft(rid, checked) == len(checked)
            except Exception as e:  # noqa: BLE001 - this request's grammar failed; the others go on
                what = "a token" if first_only else "tokens"
                self._fail(rid, f"checking {what} failed: {type(e).__name__}: {e}")
                continue
            if not ok:
                rejected.append(rid)
                self._recheck.add(rid)
        return rejected

    def verify_masks(self, drafts: Mapping[str, Sequence[int]]) -> np.ndarray:
        """Fresh bitmask rows [sum(k + 1), W] for requests verifying `drafts` (request -> its k drafts), in that
        order, k + 1 rows each (as `fill` makes them); failures are recorded in `failure`."""
        mask = _fresh("verify", sum(len(d) + 1 for d in drafts.values()), self.words)
        row = 0
        for rid, d in drafts.items():
            self._fill_verify_rows(rid, list(d), mask, row)
            row += len(d) + 1
        self.stats.num_refills += len(drafts)
        return mask

    def first_allowed(self, request_id: str, values: Sequence[float], ids: Sequence[int]) -> int | None:
        """The masked argmax among a row's top candidates (`values`, `ids`: its k largest logits), or None when it
        cannot be told from them (see `masked_argmax_among`)."""
        try:
            token = masked_argmax_among(values, ids, lambda order: self.manager.first_allowed(request_id, order))
        except Exception as e:  # noqa: BLE001 - this request's grammar failed; the others go on
            self._fail(request_id, f"checking a token failed: {type(e).__name__}: {e}")
            return None
        self.stats.num_candidate_hits += token is not None
        return token

    def first_allowed_tied(self, request_id: str, tied: Sequence[int]) -> int | None:
        """The first allowed of `tied`, or None: every token whose logit equals the k-th largest, ascending, when
        the k candidates could not tell (see `masked_argmax_among`). No token above that value is allowed, so the
        lowest allowed id among them is the masked argmax; if none is allowed, it lies below and needs the mask."""
        try:
            hit = self.manager.first_allowed(request_id, tied)
        except Exception as e:  # noqa: BLE001 - this request's grammar failed; the others go on
            self._fail(request_id, f"checking a token failed: {type(e).__name__}: {e}")
            return None
        self.stats.num_candidate_hits += hit is not None
        return None if hit is None else int(tied[hit])

    def fill_rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """Fresh bitmask rows [len(request_ids), W] for these requests, in order (rejected unmasked rows whose
        candidates settled nothing); failures are recorded in `failure`."""
        mask = _fresh("sample", len(request_ids), self.words)
        rows = list(range(len(request_ids)))  # every fill thread helps, from 2 rows: these fills hold up the device
        # alone: a library batch would wait for the next step's, filling meanwhile (scheduling ahead)
        for rid, reason in self.manager.fill_bitmask(list(request_ids), mask, rows, min_rows_per_chunk=1,
                                                     in_batches=False).items():
            self._fail(rid, reason)
        self.stats.num_refills += len(request_ids)
        self._refilled.update(request_ids)
        return mask

    def _fill_verify_rows(self, rid: str, drafts: list[int], mask: np.ndarray, row0: int) -> None:
        try:
            self.manager.fill_draft_bitmasks(rid, drafts, mask, row0)
        except Exception as e:  # noqa: BLE001 - this request's grammar failed; the others go on
            self._fail(rid, f"mask computation failed: {type(e).__name__}: {e}")

    def record_wait(self, masks: StepMasks, filled_at: float, forward_done_at: float, before_s: float = 0.0) -> None:
        """Count the mask work that outlasted the forward (perf_counter times), and `before_s` seconds of it done
        before the forward was launched, as time the device waited."""
        if masks.guided:
            self.stats.exposed_s += max(0.0, filled_at - forward_done_at) + before_s

    # ---------------------------------------------------------------------------------------------- outcome
    def accept(self, req: Request, tokens: Sequence[int], num_scheduled_drafts: int,
               unchecked: int = 0) -> tuple[bool, str | None]:
        """Feed the emitted tokens to the matcher. Returns (terminated, error). Every token here was sampled under
        the request's mask or validated (unmasked rows), so the matcher does not check them first, except the
        first `unchecked` ones (sampled before the grammar started: an implicit end of a thinking block, which the
        grammar takes only if it allows them)."""
        rid = req.request_id
        if rid in self._pending and rid not in self._thinking and tokens:
            self._early.setdefault(rid, []).extend(tokens)  # the answer began while its grammar compiles
            return False, None
        if not self._active(rid) or not tokens:
            return False, None
        m = self.manager
        try:
            if unchecked:
                self.accept_unchecked(rid, tokens[:unchecked])
                tokens = tokens[unchecked:]
                if not tokens:
                    return m.is_terminated(rid), None
            terminated = m.consume(rid, tokens)
        except Exception as e:  # noqa: BLE001 - e.g. llguidance's lexer limits on a hostile regex: this request ends
            self._fail(rid, f"{m.backend_of(rid)}: {type(e).__name__}: {e}")
            return False, self._failed[rid]
        self.stats.num_guided_tokens += len(tokens)
        forced = self._forced.pop(rid, 0)
        if forced and num_scheduled_drafts:
            self.stats.num_forced_tokens += min(forced, len(tokens) - 1)
        return terminated, None

    def accept_unchecked(self, rid: str, tokens: Sequence[int]) -> bool:
        """Tokens sampled before the grammar started (an implicit end of a thinking block): the grammar takes them
        if its language allows all of them, else none (it then starts after them): no mask chose them, so a spelling
        a mask would not have forced (`{` where llguidance's mask forces `{"`) is taken. Raises what the library
        raises."""
        m = self.manager
        taken = m.accept(rid, tokens)
        if taken < len(tokens):
            m.rollback(rid, taken)
            logger.info("request %s: the grammar does not take the tokens that ended the thinking", rid)
            return False
        return True

    def release(self, request_id: str) -> None:
        self._argmax_only.discard(request_id)
        self._recheck.discard(request_id)
        self._refilled.discard(request_id)
        self._pending.discard(request_id)
        self._ready.discard(request_id)
        self._thinking.discard(request_id)
        self._early.pop(request_id, None)
        self._forced.pop(request_id, None)
        self._failed.pop(request_id, None)
        if self._manager is not None:
            self._manager.release(request_id)

    def warm_up(self) -> None:
        """Build the default grammar backend(s) now instead of on the first guided request."""
        self.manager.warm_up()

    def stats_dict(self) -> dict[str, float]:
        """The step-level counters, plus the manager's compile / cache / mask-fill figures once it exists."""
        out: dict[str, float] = dict(self.stats.as_dict())
        if self._manager is not None:
            out.update({"grammar_" + k: v for k, v in self._manager.stats().items()})
        return out

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()


def _fresh(kind: str, rows: int, words: int) -> np.ndarray:
    return np.full((rows, words), -1, dtype=np.int32)


def masked_argmax_among(values: Sequence[float], ids: Sequence[int],
                        first_allowed: Callable[[list[int]], int | None]) -> int | None:
    """The argmax over the allowed tokens, found among a row's k largest logits (`values`, `ids`, any order), or None
    when those cannot tell it: none is allowed, or the first allowed ties the k-th value (a token outside the k with
    the same logit and a lower id would win: ties go to the lowest id, as in `torch.argmax`; the engine then walks
    every token tied at the k-th value, `first_allowed_tied`). `first_allowed(order)` gives the position of the first
    token of `order` the grammar accepts, or None."""
    order = sorted(range(len(ids)), key=lambda j: (-values[j], ids[j]))
    hit = first_allowed([int(ids[j]) for j in order])
    if hit is None or not values[order[hit]] > min(values):  # (also refuses NaN and -inf winners)
        return None
    return int(ids[order[hit]])


def _decided_by_argmax(p: SamplingParams) -> bool:
    """Greedy, and the raw logits decide: nothing but the grammar changes them, no logprobs are reported."""
    return (p.greedy and p.logprobs is None and p.allowed_token_ids is None and not p.logit_bias and p.min_tokens == 0
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


def make_guidance(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int], config: StructuredOutputConfig) -> Guidance:
    return Guidance(lambda: StructuredOutputManager(hf_tokenizer, vocab_size, eos, config), vocab_size,
                    config.unmasked_greedy, letter_tokens(hf_tokenizer, vocab_size), eos)


def letter_tokens(hf_tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """The ids of the tokens "q" and "X" when the tokenizer spells each as one token in the vocabulary, else ():
    both are allowed in free text (a JSON string), neither in JSON's structural states, numbers or literals, and
    an enum or pattern rarely allows both (a lone "a" was allowed at the start of every enum value "a...")."""
    ids: list[int] = []
    for text in ("q", "X"):
        try:
            encoded = hf_tokenizer.encode(text, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a tokenizer without this call: no probing
            return ()
        if len(encoded) != 1 or not 0 <= int(encoded[0]) < vocab_size:
            return ()
        ids.append(int(encoded[0]))
    return tuple(ids)
