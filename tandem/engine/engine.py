"""The engine: requests in, `RequestOutput`s out, one `step()` at a time.

One step, in order (the CPU works while the device runs the forward; docs/architecture.md has the table):
  1. the scheduler emits a plain-data `StepPlan` (drafts already proposed and cut by the grammars);
  2. the runner launches the forward;
  3. meanwhile the CPU fills grammar bitmasks for the rows about to be sampled, and drafts the next step ahead;
  4. the logits are collected and sampled (or drafts verified) on the tensor thread;
  5. the tokens are checked for stop conditions and the scheduler advances.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.core.kv_blocks import BlockManager
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.scheduler import RowPairs, Scheduler, pair_rows
from tandem.cpu_budget import CpuBudget
from tandem.engine.guidance import PendingMasks, StepMasks, make_guidance
from tandem.engine.sequences import RequestGroup, SequenceState
from tandem.engine.speculation import NoSpeculation, Speculation, make_speculation
from tandem.engine.step_sampler import SampleRows, StagedMasks, StepSampler, plain_rows
from tandem.engine.stop import StopChecker, StopDecision
from tandem.engine.thinking import Thinking
from tandem.engine.timing import EngineStats, StepTimer
from tandem.engine.unmasked import UnmaskedCheckPolicy
from tandem.params import ParamError, RequestOutputKind, SamplingParams
from tandem.reasoning import Reasoner
from tandem.request import Request, RequestMetrics, RequestOutput, RequestStatus
from tandem.runner.base import ForwardHandle, Runner
from tandem.sampling.sampler import Sampler, tied_ids, top_candidates
from tandem.spec_decode.config import SpeculativeConfig, build_proposer
from tandem.spec_decode.proposer import Proposer
from tandem.structured.manager import StructuredOutputConfig
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem")


@dataclass(eq=False)
class _InFlight:
    """Scheduling ahead: a launched plan, and the grammar masks its sampling will use (filled during its forward:
    `fill` while under way, `masks` once joined)."""

    plan: StepPlan
    handle: ForwardHandle
    masks: _Masks
    launched_at: float = 0.0
    filled_at: float = 0.0
    fill: PendingMasks | None = None
    garbage: set[str] = field(default_factory=set)  # requests whose row was fed a retracted token: thrown away
    verify_late: bool = False  # its drafts verified without masks are checked after the next launch
    sampling: SampleRows | None = None  # its rows as sampling takes them, made while it runs
    # seconds its launch waited for its drafts, proposed after the outcome before it (`drafts_after_outcome`); 0
    # beside an accelerator, where drafting ran beside the forward before and a redraft only repairs a miss
    drafted_s: float = 0.0

    @property
    def has_drafts(self) -> bool:
        return any(sr.num_draft_tokens for sr in self.plan.requests)

    def drafts(self) -> dict[str, list[int]]:
        """The drafts each request of the plan verifies."""
        return {sr.request_id: sr.input_ids[sr.num_tokens - sr.num_draft_tokens :]
                for sr in self.plan.requests if sr.num_draft_tokens}


@dataclass(frozen=True)
class _Masks:
    """A step's grammar masks as the grammar filled them, and as staged for sampling."""

    filled: StepMasks
    staged: StagedMasks
    exposed_s: float = 0.0  # fill seconds the forward waited for (masks filled before it was launched)


_NO_MASKS = _Masks(StepMasks(None, None), StagedMasks(None, None))
# Scheduling ahead, rows that may skip their mask are filled while the forward runs until this share of its expected
# time has passed (structured/slack_fill.py): the rest is for a row still filling (0.3-2 ms over o200k) and for the
# forward being shorter than expected. 256 guided requests beside a simulated 20 ms forward, 2 cores, 4 interleaved
# runs each: the device waited 0.60-0.68 ms a step at 0.8, 0.40-0.66 at 0.85, 0.58-0.71 at 0.9 (alike; without slack
# fills 0.83-1.26): docs/bench/simulated_slack_share.txt
SLACK_SHARE = 0.85
# Scheduling ahead, drafting for the next plan (a cheap proposer asked request by request, a draft model's late
# proposal waited for) stops at this share of the forward after its launch: scheduling, the wait for the grammar
# fills and the rest of the host's step must still fit before the forward ends
DRAFT_SHARE = 0.6
# Scheduling ahead, a proposer's deferred work (finished outputs into the suffix cache) runs once the grammar fills
# are joined, while the forward's expected time has not reached this share of it (the collect follows at its end)
TIDY_SHARE = 0.9
# Scheduling ahead with a cheap proposer, rows whose drafts were dropped (their assumed outcome did not happen) are
# drafted again between sampling and the launch, up to REDRAFT_CHUNK requests at a time, while this share of the
# shortest recent forward has not been spent and the next request's measured cost still fits in it. 0.02 held most
# redrafts that pay back: `tandem bench simulated --step-ms 20 --logits replay`, suffix / guided + suffix, tok/s at
# 0.05 against 0.02: 32 rows +6.7 / +6.5 %, 64 rows +1.6-5.5 / +7.9-9.7 %, 128 rows -0.3 / +2.6 %, 256 rows
# +1.0-2.0 / -2.2-+0.9 %, 8-16 rows the same (at 64 rows the device waited ~1.5 ms a step instead of ~1.0, for
# 5-13 % more tokens a step; 0.1 gave what 0.05 did); AMD EPYC, 2 cores, 2026-12-06 (docs/benchmarks.md)
REDRAFT_SHARE = 0.05
REDRAFT_CHUNK = 8
# ... and only while one redraft, which delays every row of the launch, costs the plan less than this many tokens of
# a step (cost x rows / forward). A redraft yields its row ~0-0.2 accepted tokens on replayed MT-Bench outputs: 256
# suffix requests beside a 20 ms step emitted 251.6 tokens a step without redrafts and 249.1-254.3 with them, while
# the device waited 6.0-6.1 % of the step without and 9.2-11.5 % with (AMD EPYC, 2 cores). At batch 1 (a miss's
# redraft is its next step's drafts: copy tasks) it stays on: 40 us x 1 row against 0.25 x a 17 ms forward.
# With the C++ suffix trie a redraft takes ~15 us and fits at 256 rows too: there, off / on in four alternating
# pairs, guided + suffix waited 8.1-9.2 / 7.0-8.4 % of the step at 8,480-8,802 / 8,703-9,195 tok/s (docs).
# Where no redraft is made the next plan is launched before its rows are settled (`_launch_next`), so a redraft
# must also pay for the walk that settling first puts before the launch. A trade, measured (REDRAFT_SHARE 0.05,
# two rounds, tok/s 0.15 / 0.25): guided + suffix at 128-256 rows within noise (4,993-5,046 / 5,024-5,087;
# 9,347-9,493 / 9,232-9,571) with the device waiting 0.3-1.0 ms a step less (256 rows: 4.8-5.4 / 6.7-7.2 % of the
# step), suffix at 64-128 rows the same with less wait (64: 2.6-3.0 / 6.4-7.4 %); but guided + suffix at 64 rows
# 3 % fewer (2,886-2,895 / 2,985-2,996) and suffix at 256 rows 1-3 % fewer (12,256-12,479 / 12,618-12,632). AMD
# EPYC, 2 cores, 2026-12-06 (docs/benchmarks.md).
REDRAFT_YIELD = 0.15
# Scheduling ahead on an accelerator, requests that their step's tokens end are taken out of the next plan before
# its launch only while it has at most this many rows: beside a whole forward saved when every row ends (batch 1:
# one a request), a row more costs an accelerator's forward little, and the check ~0.26 us a row (warm; AMD EPYC)
# on the launch's path
ENDS_CHECKED_ROWS = 16
IDLE_GAP_S = 1.0  # a longer gap between two forwards is an engine without work, not a device waiting for the host
UNMASKED_CANDIDATES = 16  # top logits tried, in order, for an unmasked greedy row whose argmax the grammar rejected
TIED_LIMIT = 64  # tokens tied at the 16th value walked before giving up (filling the mask)
YOUNG_GC_THRESHOLD = 10_000  # allocations between two young-generation collections, once started (`freeze_startup_heap`)


@contextlib.contextmanager
def gc_deferred() -> Iterator[None]:
    """No cyclic-GC pass inside (one that falls due runs at the first allocation after): for the stretch between a
    forward's end and the next launch, where a collection (0.1-1 ms at 256 requests) is time the device waits."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model's and tokenizer's Python objects) out of the cyclic GC's
    reach, as vLLM does after start-up: a full collection otherwise walks them all, and with a large vocabulary's
    tokenizer loaded that stalled the engine thread for 50-190 ms, 2-3 times in 100 steps of `tandem bench
    simulated` (gc.callbacks). They are still freed by reference counting, but a cycle among them never is: meant
    for a process that keeps its engine (`build_engine` calls it: `LLM`, the engine core; benchmarks); where engines
    come and go (tests), such cycles of each stay.

    The young generation is then collected every YOUNG_GC_THRESHOLD container allocations, not 700 (a higher setting
    of the process's own is kept): at 256 concurrent requests Python's default ran 2-3 young collections a step on
    the engine thread, 0.3-1.1 ms of GC pauses a step against 0.02-0.13 now (`gc_ms/step` of `tandem bench
    simulated`; docs/benchmarks.md, stop 67). A cycle of young objects lives at most that many allocations longer."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < YOUNG_GC_THRESHOLD:  # (0: the process turned automatic collection off; left so)
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)


class LLMEngine:
    """Continuous-batching engine over one model runner. Not thread-safe: one caller drives `step()`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer: Tokenizer,
        speculation: Speculation | None = None,
        structured_config: StructuredOutputConfig | None = None,
        mask_mode: str | None = None,
        cpu_budget: CpuBudget | None = None,
        async_scheduling: bool | None = None,
        reasoner: Reasoner | None = None,
    ) -> None:
        """`speculation` (default: off) is owned by the engine from here on: `shutdown` closes it. `reasoner`: a
        reasoning parser bound to the tokenizer (thinking split off, grammars after it, thinking budgets).

        `async_scheduling`: schedule each step while the previous one runs (see `_step_ahead`). None: on when the
        forward does not use the host's cores (an accelerator) and nothing is drafted."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.cpu_budget = cpu_budget  # reported in get_stats
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_ids = tuple(dict.fromkeys(tokenizer.eos_token_ids + config.model_config.eos_token_ids))
        self.block_manager = BlockManager(runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.speculation: Speculation = speculation or NoSpeculation()
        self._owns_speculation = True
        # a token that ends a tool call (harmony's <|call|>) is a grammar's own token, not an EOS to the backends
        grammar_eos = tuple(t for t in self.eos_token_ids if t not in tokenizer.chat_format.call_token_ids)
        structured_config = structured_config or StructuredOutputConfig()
        self.guidance = make_guidance(tokenizer.hf, self.vocab_size, grammar_eos, structured_config)
        self.grammar_in_reasoning = structured_config.enable_in_reasoning  # engine-wide: every grammar holds the thinking
        self.thinking = Thinking(reasoner, self.guidance)
        # (a) "device": bitmask copied to the device and applied there; (b) "cpu": logits brought to the host
        mask_mode = mask_mode or ("cpu" if runner.device.type == "cpu" else "device")
        if mask_mode not in ("cpu", "device"):
            raise ParamError(f"mask_mode must be 'cpu' or 'device', got {mask_mode!r}")
        self.step_sampler = StepSampler(Sampler(self.vocab_size, self.eos_token_ids), tokenizer, mask_mode, runner.device,
                                        self.thinking.limit)
        self.stats = EngineStats()
        self._groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._finished_errors: list[RequestOutput] = []
        self._async_setting = async_scheduling
        self._inflight: _InFlight | None = None  # scheduling ahead: the plan whose forward runs
        self._rows_memo: tuple[StepPlan | None, dict[str, int]] = (None, {})  # see _plain_rows
        self._forward_s: deque[float] = deque(maxlen=4)  # the last forwards' device time (see _slack_deadline)
        self._redraft_s = 0.0  # seconds one request's redraft took, smoothed (see _redraft)
        self.unmasked_checks = UnmaskedCheckPolicy()  # scheduling ahead: check unmasked argmaxes before / after a launch
        self.verify_checks = UnmaskedCheckPolicy()  # and the tokens of drafts verified without masks
        self._forward_end = 0.0  # the synchronous step: when the previous forward ended
        # grammar masks filled while the forward runs, unless the forward runs on these same cores: a fill beside it
        # preempts a thread of its OpenMP team and the whole team waits at the next barrier (measured: docs/benchmarks.md)
        self.overlap_masks = not runner.forward_uses_host_cores
        if self.overlap_masks:  # beside an accelerator: a burst's compiles run during the forward it launches
            self.guidance.hold_compiles()

    def warm_up_grammars(self) -> None:
        """Build the default grammar backend(s) now instead of on the first guided request."""
        self.guidance.warm_up()

    # ---------------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (text, or token ids). Raises ParamError for this request alone when its input is invalid."""
        params = params or SamplingParams()
        if self.grammar_in_reasoning:
            params = params.grammar_in_reasoning()
        if request_id in self._groups:
            raise ParamError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_request(prompt_ids, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, prompt_text, prompt_ids, params, RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for i in range(params.n):
            group.seqs.append(self._new_sequence(group, i, now))
        self._submit_grammars(group)
        self._groups[request_id] = group
        for seq in group.seqs:
            self._seqs[seq.request_id] = seq
            self.scheduler.add(seq.req)

    def _new_sequence(self, group: RequestGroup, index: int, now: float) -> SequenceState:
        params = group.params
        seq_id = group.request_id if params.n == 1 else f"{group.request_id}#{index}"
        seq = SequenceState(
            req=Request(seq_id, group.prompt_token_ids, params, arrival_time=now),
            group=group,
            index=index,
            stop=StopChecker(self.tokenizer, group.prompt_token_ids, params, self.max_model_len, self.eos_token_ids),
            generator=self._generator(params, index),
            logprobs=[] if params.logprobs is not None else None,
        )
        self.thinking.start(seq)
        return seq

    def _submit_grammars(self, group: RequestGroup) -> None:
        """Start compiling the group's grammar for each sequence; on a refusal nothing of the group stays behind."""
        so = group.params.structured_outputs
        if so is None:
            return
        try:
            for seq in group.seqs:
                self.guidance.submit(seq.req, so)
                self.thinking.defer_grammar(seq, overlap_compile=not self.async_scheduling)
        except ParamError:
            for seq in group.seqs:
                self.guidance.release(seq.request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed. Unknown ids are ignored."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.req.is_finished:
                self.scheduler.abort(seq.request_id)
                seq.req.status = RequestStatus.FINISHED_ABORTED
        self._release(group)

    @property
    def mask_mode(self) -> str:
        """Where grammar masks are applied: 'device' (bitmask copied there) or 'cpu' (logits brought here)."""
        return self.step_sampler.mask_mode

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._finished_errors)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return None, ids

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ParamError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ParamError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be at most {self.max_model_len - 1} to leave room for one generated token"
            )
        params.check_vocab(self.vocab_size)
        need = -(-min(self.max_model_len, len(prompt_ids) + (params.max_tokens or self.max_model_len)) // self.config.cache.block_size)
        if need > self.runner.num_blocks:
            raise ParamError(
                f"this request may need {need} KV blocks but the cache holds {self.runner.num_blocks}; "
                f"lower max_tokens or raise kv_cache_memory"
            )

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """A sequence's own generator (its seed): seeded requests sample the same tokens whatever else is in the batch
        and whatever was drafted (each token draws with its position's generator: `keyed_generator`)."""
        if params.seed is None:
            return None
        return torch.Generator(self.runner.device).manual_seed(params.seed + index)

    @property
    def async_scheduling(self) -> bool:
        """Steps are scheduled ahead (the next plan while a forward runs, drafts proposed past its outcome)."""
        if self._async_setting is not None:
            return self._async_setting
        return not self.runner.forward_uses_host_cores

    # -------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that progressed (cumulative, vLLM-style; a
        FINAL_ONLY request reports once, when it ends)."""
        if self.async_scheduling or self._inflight is not None:
            return self._step_ahead()
        timer = StepTimer()
        self._poll_grammars()
        self._draft(self.scheduler.running)
        timer.mark("drafted")
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return self._idle()
        handle, masks = self._launch(plan)  # this step's grammar masks: while the forward runs, or before it
        timer.mark("launched")
        self.guidance.start_compiles()  # the grammars of requests that arrived since: during this forward
        self._idle_since(self._forward_end, timer.at("launched"))
        self.speculation.start_lookahead(self._verifying(plan))  # CPU work while the forward runs: next drafts
        timer.mark("overlapped")
        logits = self.runner.collect(handle)  # [R, V]
        timer.mark("collected")
        tokens = self.runner.on_tensor_thread(self.step_sampler.sample, plan, logits, masks.staged, self._seqs)
        timer.mark("sampled")
        self._check_unmasked_verify(plan, logits, masks.filled, tokens)
        unsettled = self._check_unmasked(plan, logits, masks.filled, tokens)
        if unsettled:
            tokens.update(self._resample(self._rows_of(plan, logits, unsettled), unsettled))
        outputs = self._advance(plan, tokens)
        self.speculation.tidy(None)  # the synchronous step: nothing to overlap it with
        self._record_step(plan, timer, handle, masks)
        self._forward_end = handle.finished_at
        return outputs + self._drain_errors()

    def _idle_since(self, forward_end: float, launched_at: float) -> None:
        """The device sat idle from the previous forward's end to this launch (0 when it had no previous one, or
        when requests arrived after a pause: an idle engine is not a waiting device)."""
        if forward_end and 0.0 < launched_at - forward_end < IDLE_GAP_S:
            self.stats.device_idle_s += launched_at - forward_end

    def _step_ahead(self) -> list[RequestOutput]:
        """One step with the next plan scheduled while this one runs: right after sampling, the tokens go into the
        next plan and the device gets it; stop checks, detokenizing, grammar accepts, outputs and the next grammar
        masks then run during that forward. A request that ends this step has also been scheduled for the next one:
        its row there is computed and thrown away."""
        timer = StepTimer()
        self._poll_grammars()
        cur = self._inflight or self._launch_ahead(self._schedule_ahead(frozenset()), fill_now=True)
        self.guidance.start_compiles()  # the grammars of requests that arrived since: during the forward in flight
        if cur is None:
            return self._idle()
        # drafts for nxt, past cur's outcome (those that assumed another outcome are dropped once it is known);
        # with alternating groups the requests in cur sit nxt out
        parked = self.speculation.draft_ahead(self.scheduler.running, self._max_drafts,
                                              self._slack_deadline(cur, DRAFT_SHARE),
                                              shared_cores=self.runner.forward_uses_host_cores)
        nxt = self._schedule_ahead(frozenset(sr.request_id for sr in cur.plan.requests), parked)
        nxt_tokens, pairs = nxt.num_tokens, self._pairs(cur.plan, nxt)  # (for the launch's path, taken now)
        timer.mark("scheduled")
        self._join_fill(cur)
        cur.sampling = self.step_sampler.prepare(cur.plan, self._seqs)  # (the requests change only after sampling)
        self.speculation.tidy(self._slack_deadline(cur, TIDY_SHARE))  # deferred work, while the forward still runs
        with gc_deferred():  # the device waits from here to the launch
            logits = self.runner.collect(cur.handle)  # [R, V]
            timer.mark("collected")
            self._forward_s.append(cur.handle.finished_at - cur.launched_at)
            self.guidance.record_wait(cur.masks.filled, cur.filled_at, cur.handle.finished_at)
            tokens = self._sample_ahead(cur, logits, timer, nxt_tokens)
            speculative = self.speculation.active
            now, late = self._split_checks(cur, nxt_tokens)  # unmasked argmaxes checked before / after nxt's launch
            unsettled = self._check_unmasked(cur.plan, logits, cur.masks.filled, tokens, now)
            held = self._rows_of(cur.plan, logits, unsettled) if unsettled else None  # [n, V]: copied before the launch
            self._sit_out(cur, tokens, late, nxt)
            self._inflight = self._launch_next(cur.plan, tokens, nxt, frozenset(late), pairs, timer)
        self._idle_since(cur.handle.finished_at, timer.at("launched"))
        self._learn_fed(cur.plan, tokens, speculative)
        self._check_late(cur, logits, tokens, nxt, late)
        drafts = cur.drafts()
        accepted = self._accept_ahead(tokens, drafts)  # the matchers are where the next step starts: its fill may begin
        if self._inflight is not None:  # llguidance's threads fill beside the work below (nxt lacks the unsettled)
            self._inflight.fill = self.guidance.start_fill(nxt, self.step_sampler.mask_buffer, self._slack_deadline(),
                                                           self._inflight.handle.future)
            # a concurrent drafter starts on the plan after nxt: past nxt's outcome, or the requests nxt left out
            self.speculation.lookahead_ahead(self._sampling(nxt), [self._seqs[r].req for r in parked if r in self._seqs])
        self.scheduler.commit(cur.plan)  # the prefix cache learns the new full blocks while nxt runs
        if held is not None:
            self._resolve_late(cur.plan, held, unsettled, tokens)
            accepted.update(self._accept_ahead({rid: tokens[rid] for rid in unsettled}, drafts))
        outputs = self._advance_ahead(cur.plan, tokens, accepted, drafts)
        timer.mark("overlapped")
        self.stats.record_ahead(timer, len(cur.plan.preempted_ids))
        self.stats.steps_ahead_with_drafts += cur.has_drafts
        self._observe_ahead(cur)
        if self._inflight is not None and not any(sr.request_id in self._seqs for sr in nxt.requests):
            self._drop_inflight()  # every request of it has ended: nothing to collect
        return outputs + self._drain_errors()

    def _sit_out(self, cur: _InFlight, tokens: Mapping[str, list[int]], late: Sequence[str], nxt: StepPlan) -> None:
        """Take out of `nxt` (not launched) the requests of `cur` whose tokens come during its forward (or never: the
        request failed), and those `tokens` end by a stop token, an EOS or their length (`StopChecker.ends_with`),
        whose row would be computed and thrown away: at batch 1 a whole forward, before the next request's prefill.
        Ends are looked for where rows cost the forward: on the host's cores, or in a plan of at most
        `ENDS_CHECKED_ROWS` rows. Tokens a check after the launch may still change (`late`; with `cur.verify_late`,
        the drafts verified without masks) are not read for an end."""
        self.scheduler.withdraw(nxt, [rid for rid, toks in tokens.items() if not toks])
        if len(nxt.requests) > ENDS_CHECKED_ROWS and not self.runner.forward_uses_host_cores:
            return
        unsure = {*late, *(cur.masks.filled.unmasked_verify if cur.verify_late else ())}
        seqs = self._seqs
        ended = [rid for rid, toks in tokens.items() if toks and rid not in unsure and rid in seqs
                 and seqs[rid].stop.ends_with(toks)]
        self.stats.num_ended_rows_withdrawn += self.scheduler.withdraw(nxt, ended)

    def _launch_next(self, plan: StepPlan, tokens: Mapping[str, list[int]], nxt: StepPlan, unchecked: frozenset[str],
                     pairs: RowPairs | None, timer: StepTimer) -> _InFlight | None:
        """Launch `nxt` (marks 'launched') with `plan`'s outcome `tokens` in it: fed into its rows (no drafts); with
        drafts, given to the runner beside nxt and settled into its rows after the launch (`PlanEdits.outcome`: the
        device waits for no change to the rows; the rows that missed get drafts again from the next `draft_ahead`),
        or, where a redraft pays (`_redraft_budget`), the runner cannot take it or rows were withdrawn, settled and
        redrafted first (`_settle_ahead`; `unchecked`, `pairs`: as there)."""
        budget = self._redraft_budget(len(nxt.requests)) if self.speculation.active else 0.0
        drafted_s = 0.0
        if not self.speculation.active:
            self.scheduler.feed(tokens, nxt)
        elif self.runner.launches_unsettled and not nxt.edits.withdrawn and not nxt.is_empty() and budget <= 0.0:
            return self._launch_before_settle(plan, tokens, nxt, pairs, timer)
        else:
            drafted_s = self._settle_ahead(plan, tokens, nxt, unchecked, budget, pairs)
        flight = self._launch_ahead(nxt, fill_now=False)
        timer.mark("launched")
        if flight is not None and self.speculation.drafts_after_outcome:
            flight.drafted_s = drafted_s  # the step's drafting, as the synchronous step's
        return flight

    def _launch_before_settle(self, plan: StepPlan, tokens: Mapping[str, list[int]], nxt: StepPlan,
                              pairs: RowPairs | None, timer: StepTimer) -> _InFlight | None:
        """Launch `nxt` with `plan`'s outcome given beside it (`PlanEdits.outcome`: what `settle` will make of its
        rows), then settle its rows (marks 'launched' between the two)."""
        keep = self.speculation.still_valid(tokens)
        nxt.edits.outcome = self.scheduler.settled_edits(plan, tokens, nxt, keep, pairs)
        flight = self._launch_ahead(nxt, fill_now=False)
        timer.mark("launched")
        self.speculation.missed(len(self.scheduler.settle(plan, tokens, nxt, keep, pairs)))
        self.stats.steps_launched_before_settle += 1
        return flight

    def _learn_fed(self, plan: StepPlan, tokens: Mapping[str, list[int]], speculative: bool) -> None:
        """After the next launch: the requests (their token lists; with drafts their positions and blocks too) learn
        `plan`'s outcome, which `settle` (with drafts) or `feed` put only into the next plan's rows before it."""
        if speculative:
            self.scheduler.confirm()
        else:
            self.scheduler.resolve(plan, tokens, None, commit=False)

    def _sample_ahead(self, cur: _InFlight, logits: torch.Tensor, timer: StepTimer,
                      nxt_tokens: int) -> dict[str, list[int]]:
        """The tokens of `cur`'s rows `logits` [R, V], those of rows fed a retracted token left out; marks
        'sampled', then checks the drafts verified without masks (`_check_unmasked_verify`: host work), unless
        `verify_checks` moves that check past the launch of the next plan (`nxt_tokens` tokens; `cur.verify_late`)."""
        tokens = self.runner.on_tensor_thread(self.step_sampler.sample, cur.plan, logits, cur.masks.staged, self._seqs,
                                              cur.sampling)
        for rid in cur.garbage:
            tokens.pop(rid, None)
        timer.mark("sampled")
        cur.verify_late = bool(cur.masks.filled.unmasked_verify) and self.verify_checks.after_launch(
            nxt_tokens, min(self._forward_s, default=0.0))
        if not cur.verify_late:
            self._check_unmasked_verify(cur.plan, logits, cur.masks.filled, tokens)
        return tokens

    def _split_checks(self, cur: _InFlight, nxt_tokens: int) -> tuple[list[str], list[str]]:
        """`cur`'s unmasked argmaxes to check before the launch of the next plan (`nxt_tokens` tokens), and after it
        (see engine/unmasked.py): all after it where the policy says so (a rejected one is retracted, its row of the
        next plan thrown away with any drafts it verifies: `Scheduler.retract`)."""
        unmasked = cur.masks.filled.unmasked
        if not unmasked or not self.unmasked_checks.after_launch(nxt_tokens, min(self._forward_s, default=0.0)):
            return unmasked, []
        return [], unmasked

    def _pairs(self, plan: StepPlan, nxt: StepPlan) -> RowPairs | None:
        """With drafts: `plan`'s rows paired with nxt's, what `settle` walks (taken while plan's forward runs)."""
        return pair_rows(plan, nxt) if self.speculation.active else None

    def _settle_ahead(self, plan: StepPlan, tokens: Mapping[str, list[int]], nxt: StepPlan,
                      unchecked: frozenset[str], budget: float, pairs: RowPairs | None = None) -> float:
        """Before nxt's launch, with drafts: `plan`'s outcome into nxt's rows (rows whose drafts assumed another
        outcome lose them, rows after a rejected draft move back; the requests learn it after the launch, in
        `_learn_fed`), then drafts again, from the real outcome, for as many of those rows as a small share of a
        forward's time allows (cheap proposers; those requests learn their outcome first); none for the
        `unchecked` (their argmax is checked after the launch: their rows stay without drafts); `budget`: seconds the
        redrafts may take (`_redraft_budget`). `pairs`: plan's rows with nxt's (`pair_rows`), taken while plan ran.
        Returns the seconds the redrafts took (the launch waited for them)."""
        changed = self.scheduler.settle(plan, tokens, nxt, self.speculation.still_valid(tokens), pairs)
        self.speculation.missed(len(changed))
        if budget <= 0.0:
            return 0.0
        t0 = time.perf_counter()
        # those that lost their drafts first, then the other rows without any (their proposal past the outcome in
        # flight had nothing: the real outcome may match)
        lost = set(changed)
        bare = changed + [sr.request_id for sr in nxt.requests if sr.num_tokens == 1 and sr.needs_logits
                          and not sr.num_draft_tokens and sr.request_id not in lost and sr.request_id not in unchecked]
        drafts = self._redraft(bare, budget)
        if drafts:
            self.scheduler.add_drafts(nxt, drafts)
        return time.perf_counter() - t0

    def _redraft_budget(self, rows: int) -> float:
        """Seconds the launch of a plan of `rows` rows may wait for redrafts: `REDRAFT_SHARE` of the shortest recent
        forward; none while one redraft costs the plan more than `REDRAFT_YIELD` tokens of a step, or the proposer
        is not cheap. Drafting after the outcome (`Speculation.drafts_after_outcome`), the whole forward's time: they
        are the step's drafts."""
        if not self.speculation.drafts_cheaply or not self._forward_s:
            return 0.0
        forward = min(self._forward_s)
        if self.speculation.drafts_after_outcome:  # every row's drafts, as the synchronous step's before its launch
            return forward
        return 0.0 if self._redraft_s * rows > REDRAFT_YIELD * forward else REDRAFT_SHARE * forward

    def _redraft(self, request_ids: list[str], budget: float) -> dict[str, list[int]]:
        """Drafts, now, for the first of `request_ids`: as many as `budget` seconds hold at their measured cost."""
        t0 = time.perf_counter()
        drafts: dict[str, list[int]] = {}
        i = 0
        while i < len(request_ids):
            t = time.perf_counter()
            n = min(REDRAFT_CHUNK, int((budget - (t - t0)) / max(self._redraft_s, 1e-6)))  # those that still fit
            if n <= 0:
                break
            chunk = request_ids[i : i + n]
            i += n
            self.scheduler.confirm(chunk)  # a proposer reads their tokens
            reqs = [self._seqs[rid].req for rid in chunk if rid in self._seqs]
            drafts.update(self.speculation.redraft(reqs, self._max_drafts))
            if reqs:  # the cost of one request's redraft, smoothed (its tree's size and the proposer's state move it)
                self._redraft_s += 0.25 * ((time.perf_counter() - t) / len(reqs) - self._redraft_s)
        return drafts

    def _sampling(self, plan: StepPlan) -> list[Request]:
        """The live requests of `plan` that sample in it."""
        return [self._seqs[sr.request_id].req for sr in plan.requests if sr.needs_logits and sr.request_id in self._seqs]

    def _observe_ahead(self, flight: _InFlight) -> None:
        """Adaptive K learns the step's cost: the forward's tokens and device time, and the time its launch waited
        for drafts made after the outcome (`drafted_s`; drafting past it ran beside the forward before)."""
        self.speculation.observe_step(flight.plan.num_tokens, flight.handle.finished_at - flight.launched_at,
                                      flight.drafted_s, shared_cores=self.runner.forward_uses_host_cores)

    def _schedule_ahead(self, running: frozenset[str], parked: frozenset[str] = frozenset()) -> StepPlan:
        """The next plan, accounted before it runs; `running` (the plan in flight) is never preempted for it,
        `parked` requests sit it out."""
        plan = self.scheduler.schedule(running, parked)
        self.scheduler.reserve(plan)
        self.runner.prepare(plan)  # its block tables read while the forward in flight runs
        return plan

    def _slack_deadline(self, flight: _InFlight | None = None, share: float = SLACK_SHARE) -> float | None:
        """When the forward of `flight` (default: the one in flight) is expected to end, less a margin (`share`
        of it from the launch: `SLACK_SHARE` for mask fills): by the shortest of the last few forwards (device
        time: launch to the device's end, whenever it was collected); None before one, and when the forward runs
        on the host's own cores (work beside it would slow it)."""
        flight = flight or self._inflight
        if flight is None or not self._forward_s or self.runner.forward_uses_host_cores:
            return None
        return flight.launched_at + share * max(0.0, min(self._forward_s))

    def _launch_ahead(self, plan: StepPlan, fill_now: bool) -> _InFlight | None:
        if plan.is_empty():
            return None
        launched_at = time.perf_counter()
        flight = _InFlight(plan, self.runner.launch(plan), _NO_MASKS, launched_at)
        if fill_now:
            flight.masks = self._fill_masks(plan)
            flight.filled_at = time.perf_counter()
        return flight

    def _drop_inflight(self) -> None:
        """Forget the plan in flight: its fill stops and ends first (the next fill may reuse its buffer)."""
        if self._inflight is not None and self._inflight.fill is not None:
            self._inflight.fill.stop_slack()
            self._join_fill(self._inflight)
        self._inflight = None

    def _join_fill(self, flight: _InFlight) -> None:
        """Wait for the masks of `flight` (filled during its forward) and stage them for sampling."""
        if flight.fill is None:
            return
        filled, flight.fill = flight.fill.result(), None
        flight.masks = _Masks(filled, self.step_sampler.stage(filled))
        flight.filled_at = time.perf_counter()

    def _launch(self, plan: StepPlan) -> tuple[ForwardHandle, _Masks]:
        """Start the forward of `plan` and fill its grammar masks: after the launch (overlapped) when the forward has
        its own device, before it when the forward shares the host's cores (`overlap_masks`)."""
        if self.overlap_masks:
            handle = self.runner.launch(plan)
            return handle, self._fill_masks(plan)
        t0 = time.perf_counter()
        masks = self._fill_masks(plan)
        masks = _Masks(masks.filled, masks.staged, time.perf_counter() - t0 if masks.filled.guided else 0.0)
        return self.runner.launch(plan), masks

    def _fill_masks(self, plan: StepPlan) -> _Masks:
        """The plan's grammar masks, filled on the CPU and their copy to the device started at once."""
        masks = self.guidance.fill(plan, self.step_sampler.mask_buffer)
        return _Masks(masks, self.step_sampler.stage(masks))

    def _accept_ahead(self, new_tokens: Mapping[str, list[int]],
                      drafts: Mapping[str, list[int]]) -> dict[str, tuple[bool, str | None]]:
        """Scheduling ahead: feed each live guided sequence's tokens to its grammar before the stop checks, so that
        the next step's fill can start (`drafts`: what each verified). {request: (terminated, error)} for those
        fed. Tokens a stop check then drops were taken too: that sequence has ended, its matcher is not used again."""
        accepted: dict[str, tuple[bool, str | None]] = {}
        for rid, toks in new_tokens.items():
            seq = self._seqs.get(rid)
            if not toks or seq is None or seq.req.is_finished or self.guidance.failure(rid) is not None:
                continue  # (no tokens: an unsettled row, sampled with its mask later)
            answer_from, unchecked = self.thinking.feed(seq, toks)
            accepted[rid] = self.guidance.accept(seq.req, toks[answer_from:], len(drafts.get(rid, ())),
                                                 unchecked=unchecked)
        return accepted

    def _advance_ahead(self, plan: StepPlan, new_tokens: dict[str, list[int]],
                       accepted: Mapping[str, tuple[bool, str | None]],
                       drafts: Mapping[str, list[int]]) -> list[RequestOutput]:
        """`_advance` for a plan already accounted by `reserve` / `resolve` (or `settle`): settle each sequence
        (`accepted`: the grammar outcomes of `_accept_ahead`; `drafts`: what each verified), finish what ended
        (dropping tokens it did not keep); outputs of touched groups."""
        finished: dict[str, tuple[RequestStatus, int]] = {}  # -> (final status, tokens to drop)
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for rid, toks in new_tokens.items():
            seq = self._seqs.get(rid)
            if seq is None or seq.req.is_finished:
                continue
            kept, status = self._settle(seq, toks, accepted.get(rid), drafts.get(rid, []))
            if status is not None:
                finished[rid] = (status, len(toks) - len(kept) if toks and status else 0)
            if seq.group.metrics.first_token_time is None:
                seq.group.metrics.first_token_time = now
            touched[seq.group.request_id] = seq.group
            self.stats.num_generated_tokens += len(kept)
        for rid, (status, drop) in finished.items():
            req = self._seqs[rid].req
            self.scheduler.finish(rid, status)  # also forgets the placeholder of the plan now running
            if drop:
                del req.token_ids[len(req.token_ids) - drop :]
            req.status = status
        self.stats.num_prompt_tokens += sum(sr.num_tokens for sr in plan.requests if sr.is_prefill)
        return self._outputs(touched.values(), now)

    def _check_late(self, cur: _InFlight, logits: torch.Tensor, tokens: dict[str, list[int]], nxt: StepPlan,
                    late: Sequence[str]) -> None:
        """After `nxt`'s launch, before `cur`'s tokens count: the checks the policies moved past it (the drafts
        verified without masks, then the `late` unmasked argmaxes)."""
        if cur.verify_late:
            self._check_verify_after_launch(cur.plan, logits, cur.masks.filled, tokens, nxt)
        if late:
            self._check_after_launch(cur.plan, logits, cur.masks.filled, tokens, nxt, late)

    def _check_verify_after_launch(self, plan: StepPlan, logits: torch.Tensor, masks: StepMasks,
                                   tokens: dict[str, list[int]], nxt: StepPlan) -> None:
        """Scheduling ahead: `nxt` was launched, and `plan` settled, with the unchecked tokens of the drafts
        `plan` verified without masks. Check them now, while it runs: a request whose tokens its grammar rejects
        is verified again with its masks (from `logits` [R, V], which no forward writes again), its tokens from the
        first that changed rewritten (`Scheduler.rewrite`) and its row of `nxt`, drafts and all, thrown away when
        collected (the request sits out that step)."""
        replaced = self._check_unmasked_verify(plan, logits, masks, tokens, late=True)
        if not replaced:
            return
        rows = {sr.request_id: sr for sr in plan.requests if sr.request_id in replaced}
        inflight = self._inflight
        for rid, old in replaced.items():
            new = tokens.get(rid)
            if not old or new is None or new == old or rid not in rows or self.guidance.failure(rid) is not None:
                continue
            same = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            sr = rows[rid]
            first = sr.start_pos + sr.num_tokens - sr.num_draft_tokens  # where its emitted tokens start
            if self.scheduler.rewrite(nxt, rid, first + same, new[same:]) and inflight is not None:
                inflight.garbage.add(rid)
                self.stats.num_rewritten_rows += 1

    def _check_after_launch(self, plan: StepPlan, logits: torch.Tensor, masks: StepMasks,
                            tokens: dict[str, list[int]], nxt: StepPlan, unchecked: Sequence[str]) -> None:
        """Scheduling ahead: `nxt` was launched fed the `unchecked` rows' argmaxes (each such row of `nxt`
        verifying no drafts), and `plan` resolved or settled with them. Check them now, while it runs: a rejected
        one is replaced by the masked argmax (a top candidate, or its row of `logits` [R, V], which no forward writes
        again, sampled with its mask filled) and retracted, its row of `nxt` thrown away when collected (the request
        sits out that step)."""
        argmax = {rid: toks[0] for rid in unchecked if (toks := tokens.get(rid))}
        unsettled = self._check_unmasked(plan, logits, masks, tokens, unchecked)
        if unsettled:
            tokens.update(self._resample(self._rows_of(plan, logits, unsettled), unsettled, late=True))
        inflight = self._inflight
        for sr in plan.requests:
            rid = sr.request_id
            toks = tokens.get(rid)
            if rid not in argmax or not toks or toks[0] == argmax[rid] or self.guidance.failure(rid) is not None:
                continue
            if self.scheduler.retract(nxt, rid, sr.start_pos + sr.num_tokens, toks[0]) and inflight is not None:
                inflight.garbage.add(rid)
                self.stats.num_retracted_rows += 1

    def _check_unmasked(self, plan: StepPlan, logits: torch.Tensor, masks: StepMasks,
                        tokens: dict[str, list[int]], unmasked: Sequence[str] | None = None) -> list[str]:
        """Greedy rows sampled without their grammar mask (`unmasked`, default all of `masks.unmasked`): keep each
        token the grammar accepts; for the others take the first allowed of the row's top candidates. Returns the
        rows still unsettled, their tokens in `tokens` emptied: `_resample` them with their masks. The top candidates
        count as sampling (`stats.sample_s`, device work beside an accelerator), the checks as host time."""
        unmasked = masks.unmasked if unmasked is None else unmasked
        if not unmasked:
            return []
        t0 = time.perf_counter()
        rejected = self.guidance.check_unmasked(unmasked, tokens)
        self.unmasked_checks.observe(len(unmasked), len(rejected), time.perf_counter() - t0)
        if not rejected:
            return []
        rows = self._plain_rows(plan)
        t0 = time.perf_counter()
        candidates = self.runner.on_tensor_thread(top_candidates, logits, [rows[r] for r in rejected], UNMASKED_CANDIDATES)
        self.stats.sample_s += time.perf_counter() - t0
        undecided: list[tuple[str, float]] = []  # (request, the k-th largest logit)
        for rid, (values, ids) in zip(rejected, candidates, strict=True):
            token = self.guidance.first_allowed(rid, values, ids)
            if token is not None:
                tokens[rid] = [token]
            elif self.guidance.failure(rid) is None:
                nan = any(map(math.isnan, values))  # then only the mask decides: no tie walk (an infinite value)
                undecided.append((rid, math.inf if nan else min(values)))
        return self._check_ties(rows, logits, undecided, tokens)

    def _check_unmasked_verify(self, plan: StepPlan, logits: torch.Tensor, masks: StepMasks,
                               tokens: dict[str, list[int]], late: bool = False) -> dict[str, list[int]]:
        """Greedy requests that verified their drafts without masks: keep the tokens their grammar takes in turn;
        verify the others again now, with their masks filled (a rejected argmax: rare with a real model), their
        tokens in `tokens` replaced; returns those requests' tokens before. The verification counts as sampling
        (`stats.sample_s`; `late`: during the next forward, `stats.late_sample_s`)."""
        if not masks.unmasked_verify:
            return {}
        t0 = time.perf_counter()
        checked = self.guidance.check_unmasked_verify(masks.unmasked_verify, tokens)
        self.verify_checks.observe(len(masks.unmasked_verify), len(checked), time.perf_counter() - t0)
        rejected = [rid for rid in checked if rid in self._seqs]
        if not rejected:
            return {}
        before = {rid: tokens.get(rid, []) for rid in rejected}
        drafts = {sr.request_id: sr.input_ids[-sr.num_draft_tokens:] for sr in plan.requests if sr.num_draft_tokens}
        mask = self.guidance.verify_masks({rid: drafts[rid] for rid in rejected})  # [sum(k + 1), W]
        t0 = time.perf_counter()
        tokens.update(self.runner.on_tensor_thread(self.step_sampler.verify_masked, plan, logits, mask, self._seqs,
                                                   rejected))
        if late:
            self.stats.late_sample_s += time.perf_counter() - t0
        else:
            self.stats.sample_s += time.perf_counter() - t0
        return before

    def _check_ties(self, rows: Mapping[str, int], logits: torch.Tensor, undecided: list[tuple[str, float]],
                    tokens: dict[str, list[int]]) -> list[str]:
        """Rows the top candidates left undecided: walk every token tied at the k-th value (bf16 logits tie often);
        the rest are unsettled, their tokens emptied."""
        finite = [(rid, v) for rid, v in undecided if math.isfinite(v)]
        t0 = time.perf_counter()
        tied = self.runner.on_tensor_thread(tied_ids, logits, [rows[r] for r, _ in finite], [v for _, v in finite],
                                            TIED_LIMIT) if finite else []
        self.stats.sample_s += time.perf_counter() - t0
        settled = {}
        for (rid, _), ids in zip(finite, tied, strict=True):
            token = self.guidance.first_allowed_tied(rid, ids) if ids else None
            if token is not None:
                settled[rid] = token
        unsettled = []
        for rid, _ in undecided:
            if rid in settled:
                tokens[rid] = [settled[rid]]
            elif self.guidance.failure(rid) is None:
                unsettled.append(rid)
                tokens[rid] = []
        return unsettled

    def _rows_of(self, plan: StepPlan, logits: torch.Tensor, request_ids: Sequence[str]) -> torch.Tensor:
        """The plain logits rows of `request_ids` [n, V], in that order (a copy).
        The copy counts as sampling (`stats.sample_s`): device work beside an accelerator."""
        rows = self._plain_rows(plan)
        index = torch.tensor([rows[rid] for rid in request_ids], device=logits.device)
        t0 = time.perf_counter()
        held = self.runner.on_tensor_thread(logits.index_select, 0, index)
        self.stats.sample_s += time.perf_counter() - t0
        return held

    def _plain_rows(self, plan: StepPlan) -> dict[str, int]:
        """`plain_rows(plan)`, made once per plan (asked for after its sampling, when it no longer changes)."""
        if self._rows_memo[0] is not plan:
            self._rows_memo = (plan, plain_rows(plan))
        return self._rows_memo[1]

    def _resample(self, logits: torch.Tensor, request_ids: Sequence[str], late: bool = False) -> dict[str, list[int]]:
        """Fill the masks of `request_ids` and sample their rows `logits` [n, V] (in that order) with them. The
        sampling counts as `stats.sample_s`, or, `late` (during the next forward, off the device's critical path),
        as `stats.late_sample_s`."""
        mask = self.guidance.fill_rows(request_ids)
        rows = {rid: i for i, rid in enumerate(request_ids)}
        t0 = time.perf_counter()
        tokens = self.runner.on_tensor_thread(self.step_sampler.sample_masked, rows, logits, mask, self._seqs, request_ids)
        if late:
            self.stats.late_sample_s += time.perf_counter() - t0
        else:
            self.stats.sample_s += time.perf_counter() - t0
        return tokens

    def _resolve_late(self, plan: StepPlan, logits: torch.Tensor, request_ids: Sequence[str],
                      tokens: dict[str, list[int]]) -> None:
        """Scheduling ahead: sample the unsettled rows `logits` [n, V] of `plan` with their masks while the next
        forward (which they sit out) runs, and resolve their placeholders; `tokens` gets them."""
        late = self._resample(logits, request_ids, late=True)
        mine = set(request_ids)
        self.scheduler.resolve(StepPlan(plan.step_id, [sr for sr in plan.requests if sr.request_id in mine]), late, None)
        tokens.update(late)
        self.stats.num_late_rows += len(request_ids)

    def _draft(self, running: Sequence[Request]) -> None:
        """Drafts for the next step: the proposer's, cut by the grammars, or the grammars' forced tokens."""
        self.speculation.draft(running, self._max_drafts)
        self.guidance.constrain_drafts(running, self._max_drafts)

    def _verifying(self, plan: StepPlan) -> list[Request]:
        return [self._seqs[sr.request_id].req for sr in plan.requests if sr.num_draft_tokens]

    def _idle(self) -> list[RequestOutput]:
        """Nothing could be scheduled this step."""
        self.guidance.start_compiles()
        self.speculation.tidy(None)
        if self.guidance.has_pending:
            time.sleep(0.002)  # only grammar compiles are outstanding: let them run
        return self._drain_errors()

    def _record_step(self, plan: StepPlan, timer: StepTimer, handle: ForwardHandle, masks: _Masks) -> None:
        self.stats.record(timer, len(plan.preempted_ids))
        self.guidance.record_wait(masks.filled, timer.at("overlapped"), handle.finished_at, masks.exposed_s)
        self.speculation.observe_step(plan.num_tokens, timer.span("drafted", "collected"), timer.span("start", "drafted"))

    def _max_drafts(self, req: Request) -> int:
        """Drafts this request may take: every emitted token must fit max_tokens and max_model_len."""
        if req.request_id not in self._seqs:
            return 0
        limit = self.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            limit = min(limit, req.params.max_tokens - req.num_output_tokens)
        return max(0, limit - 1)

    def _poll_grammars(self) -> None:
        """Lift the hold of requests whose grammar compiled; fail those whose compile failed."""
        self._share_cores_with_compiles()
        if not self.guidance.has_pending:
            return
        ready, failed = self.guidance.poll()
        for rid, backend, reason in ready:
            seq = self._seqs.get(rid)
            if seq is not None:
                seq.req.hold_sampling = False
                seq.group.metrics.grammar_backend = backend
                seq.group.metrics.grammar_backend_reason = reason
        for rid, reason in failed:
            seq = self._seqs.get(rid)
            if seq is not None:
                self._fail(seq, reason)

    def _share_cores_with_compiles(self) -> None:
        """While grammars compile, the forward on the CPU gives up as many threads as compiles run (up to the
        budget's grammar threads), so a compile gets a core instead of starving behind spinning OpenMP threads."""
        budget = self.cpu_budget
        if budget is None or self.runner.device.type != "cpu":
            return
        lent = min(self.guidance.num_compiling, budget.grammar_threads, budget.forward_threads - 1)
        self.runner.set_num_threads(budget.forward_threads - max(0, lent))

    def _fail(self, seq: SequenceState, reason: str) -> None:
        """End one sequence with an error (its group reports it); the rest of the batch is untouched."""
        self.scheduler.abort(seq.request_id)
        seq.req.status = RequestStatus.FINISHED_ERROR
        seq.group.error = reason
        if seq.group.finished:
            self._finished_errors.append(seq.group.output())
            self._release(seq.group)

    # ------------------------------------------------------------------------------------------------ advance
    def _advance(self, plan: StepPlan, new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        """Cut new tokens at stop conditions, advance the scheduler, finish what ended; outputs of touched groups."""
        finished: dict[str, RequestStatus] = {}  # one final status per sequence
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for rid, toks in new_tokens.items():
            seq = self._seqs[rid]
            new_tokens[rid], status = self._settle(seq, toks)
            if status is not None:
                finished[rid] = status
            if seq.group.metrics.first_token_time is None:
                seq.group.metrics.first_token_time = now
            touched[seq.group.request_id] = seq.group
        for rid in [rid for rid, toks in new_tokens.items() if not toks]:  # failed before emitting anything
            del new_tokens[rid]
            self.scheduler.finish(rid, finished[rid])
        self.scheduler.update(plan, new_tokens)
        self._finish(finished)
        self.stats.num_generated_tokens += sum(len(t) for t in new_tokens.values())
        self.stats.num_prompt_tokens += sum(self._prompt_positions(sr) for sr in plan.requests)
        return self._outputs(touched.values(), now)

    def _prompt_positions(self, sr: ScheduledRequest) -> int:
        """How many prompt positions this step computed for `sr` (a guided request's last prompt token comes in the
        step after its grammar compiled, outside its prefill)."""
        seq = self._seqs.get(sr.request_id)
        if seq is None:
            return 0
        end = min(sr.start_pos + sr.num_tokens - sr.num_draft_tokens, len(seq.group.prompt_token_ids))
        return max(0, end - sr.start_pos)

    def _settle(self, seq: SequenceState, toks: list[int], accepted: tuple[bool, str | None] | None = None,
                drafts: Sequence[int] | None = None) -> tuple[list[int], RequestStatus | None]:
        """One sequence's emitted tokens: the ones it keeps, and its final status if it ended. `accepted`: the
        grammar has taken `toks` already, with this outcome (it had not failed before); else the kept tokens are
        fed to it here. `drafts`: what it verified (default: its `draft_token_ids`, the synchronous step's).

        Per-request work that fails (its grammar, detokenizing) ends this sequence alone with an error, as does a
        row where no token is allowed (after the drafts accepted before it, which it keeps)."""
        failure = self.guidance.failure(seq.request_id) if accepted is None else None
        no_token = self.step_sampler.failures.get(seq.request_id)
        if failure is not None or (no_token is not None and not toks):  # the sampled token means nothing
            seq.group.error = failure or no_token
            return [], RequestStatus.FINISHED_ERROR
        answer_from, unchecked = self.thinking.feed(seq, toks) if accepted is None else (0, 0)
        ending = self.guidance.through_end(seq.request_id, toks, answer_from)
        try:
            decision = seq.stop.add_tokens(ending)
        except Exception as e:  # noqa: BLE001 - one broken request must not take the batch down
            logger.exception("request %s failed while detokenizing", seq.request_id)
            seq.group.error = f"{type(e).__name__}: {e}"
            return toks, RequestStatus.FINISHED_ERROR
        kept = ending[: decision.num_tokens_kept]
        drafts = seq.req.draft_token_ids if drafts is None else drafts
        self._learn_drafts(seq, drafts, toks)
        if seq.logprobs is not None and len(kept) < len(toks):  # the entries (and sum) of the tokens dropped
            n = len(toks) - len(kept)
            seq.cumulative_logprob -= sum(entry[t].logprob for entry, t in zip(seq.logprobs[-n:], toks[-n:]))
            del seq.logprobs[-n:]
        if accepted is None:
            accepted = self.guidance.accept(seq.req, kept[answer_from:], len(drafts),
                                            unchecked=max(0, min(unchecked, len(kept) - answer_from)))
        terminated, grammar_error = accepted
        status = self._final_status(seq, decision, terminated, grammar_error or no_token)
        if status is not None and status is not RequestStatus.FINISHED_ERROR:
            try:
                seq.stop.decode_deferred()  # a request reporting only its final output is detokenized now
            except Exception as e:  # noqa: BLE001 - one broken request must not take the batch down
                logger.exception("request %s failed while detokenizing", seq.request_id)
                seq.group.error = f"{type(e).__name__}: {e}"
                return kept, RequestStatus.FINISHED_ERROR
        return kept, status

    def _learn_drafts(self, seq: SequenceState, drafts: Sequence[int], emitted: list[int]) -> None:
        """Let speculation learn how the proposer's drafts fared (grammar-forced drafts are not the proposer's)."""
        if self.guidance.drafts_were_forced(seq.request_id):
            return
        seq.group.metrics.num_draft_tokens += len(drafts)
        seq.group.metrics.num_accepted_tokens += self.speculation.observe(seq.req, drafts, emitted)

    @staticmethod
    def _final_status(
        seq: SequenceState, decision: StopDecision, terminated: bool, grammar_error: str | None
    ) -> RequestStatus | None:
        if decision.finished:  # ends normally; the matcher's view of its last token no longer matters
            seq.req.stop_reason = decision.stop_reason
            return RequestStatus.FINISHED_STOPPED if decision.reason == "stop" else RequestStatus.FINISHED_LENGTH
        if grammar_error is not None:
            seq.group.error = grammar_error
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if terminated else None

    def _finish(self, finished: Mapping[str, RequestStatus]) -> None:
        """Final statuses; the scheduler frees the blocks of those it still holds."""
        for rid, status in finished.items():
            if self.scheduler.get(rid) is not None:
                self.scheduler.finish(rid, status)
            self._seqs[rid].req.status = status

    def _outputs(self, groups: Iterable[RequestGroup], now: float) -> list[RequestOutput]:
        """The outputs of `groups` that report now (all but the unfinished FINAL_ONLY ones); finished ones released."""
        outputs = []
        for g in groups:
            if g.finished:
                g.metrics.finished_time = now
                outputs.append(g.output())
                self._release(g)
            elif g.params.output_kind is RequestOutputKind.CUMULATIVE:
                outputs.append(g.output())
        return outputs

    def _release(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)
        for s in group.seqs:
            self._seqs.pop(s.request_id, None)
            self.speculation.release(s.request_id)
            self.guidance.release(s.request_id)

    def _drain_errors(self) -> list[RequestOutput]:
        out, self._finished_errors = self._finished_errors, []
        return out

    # ------------------------------------------------------------------------------------------ configuration
    def set_speculation(
        self, config: SpeculativeConfig | Mapping[str, Any] | None, proposer: Proposer | None = None
    ) -> None:
        """Switch speculative decoding between runs (no request may be in flight); None turns it off.

        Without `proposer` one is built from `config` and closed with the engine or at the next switch; a given
        proposer stays the caller's to close.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("set_speculation needs an idle engine: requests are in flight")
        self._drop_inflight()
        if self._owns_speculation:
            self.speculation.close()
        sc = SpeculativeConfig.from_dict(config) if config is not None else None
        self._owns_speculation = proposer is None
        if sc is not None and proposer is None:
            proposer = build_proposer(sc, self.vocab_size, self.tokenizer)
        self.speculation = make_speculation(sc, proposer, self.max_model_len)

    def set_reasoning(self, parser: str | Mapping[str, Any] | None) -> None:
        """Switch the reasoning parser between runs (no request may be in flight); None turns it off."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_reasoning needs an idle engine: requests are in flight")
        self.thinking = Thinking(Reasoner(parser, self.tokenizer) if parser is not None else None, self.guidance)
        self.step_sampler.limit = self.thinking.limit

    def shutdown(self) -> None:
        """Abort what runs, stop the draft worker, the grammar pools and the forward thread."""
        for rid in list(self._groups):
            self.abort_request(rid)
        if self._owns_speculation:
            self.speculation.close()
        self.guidance.shutdown()
        self.runner.shutdown()

    def kv_pool_stats(self) -> dict[str, int]:
        """The KV pool in bytes: reserved (planned at start), touched (its blocks ever used: on the host, the pages
        committed), used (held by requests), retained (cached prefixes no request holds), resident (measured)."""
        bm, per_block = self.block_manager, self.runner.kv_block_bytes
        return {
            "kv_pool_reserved_bytes": bm.num_blocks * per_block,
            "kv_pool_touched_bytes": bm.num_touched * per_block,
            "kv_pool_used_bytes": bm.num_used_blocks * per_block,
            "kv_pool_retained_bytes": bm.num_retained_blocks * per_block,
            "kv_pool_resident_bytes": self.runner.kv_cache_resident_bytes(bm.num_touched),
            "prefix_cache_retained_blocks": bm.num_retained_blocks,
        }

    def get_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": bm.usage,
            "kv_num_blocks": self.runner.num_blocks,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            **self.kv_pool_stats(),
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            **self.stats.__dict__,
            "device_idle_ms_per_step": round(1e3 * self.stats.device_idle_s / max(1, self.stats.num_steps), 3),
            **self.speculation.stats_dict(),
            **self.guidance.stats_dict(),
            **self.runner.stats_dict(),
            **(self.cpu_budget.as_dict() if self.cpu_budget is not None else {}),
        }
