"""The engine: requests in, `RequestOutput`s out, one `step()` at a time.

One step, in order (the CPU works while the device runs the forward):
  1. the scheduler emits a plain-data `StepPlan`;
  2. the runner launches the forward;
  3. meanwhile the CPU fills grammar bitmasks for the rows about to be sampled;
  4. the logits are collected and sampled (or drafts verified);
  5. the tokens are checked for stop conditions and the scheduler advances.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.core.kv_blocks import BlockManager
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.scheduler import Scheduler
from tandem.cpu_budget import CpuBudget
from tandem.engine.guidance import StepMasks, make_guidance
from tandem.engine.speculation import SpeculativeDecoder
from tandem.engine.stop import StopChecker
from tandem.params import ParamError, SamplingParams
from tandem.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from tandem.runner.runner import ModelRunner
from tandem.sampling.rejection import DraftRows, rejection_sample
from tandem.sampling.sampler import RowLogprobs, Sampler, SamplingRow, prompt_logprobs
from tandem.structured.manager import StructuredOutputConfig
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem")


@dataclass(eq=False)
class _Sequence:
    """Engine-side extras of one scheduled sequence (one of a request's `n` completions)."""

    req: Request
    group: _Group
    index: int
    stop: StopChecker
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass(eq=False)
class _Group:
    """One user request: its prompt and its `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    forward_s: float = 0.0
    cpu_overlap_s: float = 0.0  # CPU work done while the forward ran
    draft_s: float = 0.0  # drafting before the step (the device waits for it)
    sample_s: float = 0.0


class LLMEngine:
    """Continuous-batching engine over one model runner. Not thread-safe: one caller drives `step()`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        speculation: SpeculativeDecoder | None = None,
        structured_config: StructuredOutputConfig | None = None,
        mask_mode: str | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model_config.vocab_size
        eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + config.model_config.eos_token_ids))
        self.eos_token_ids = eos
        self.block_manager = BlockManager(runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler(self.vocab_size, eos)
        self.stats = EngineStats()
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._finished_errors: list[RequestOutput] = []
        self._step_id = itertools.count()
        self.spec = speculation
        self.cpu_budget: CpuBudget | None = None  # set by build_engine; reported in get_stats
        self.guidance = make_guidance(tokenizer.hf, self.vocab_size, eos, structured_config or StructuredOutputConfig())
        # (a) "device": bitmask copied to the device and applied there; (b) "cpu": logits brought to the host
        self.mask_mode = mask_mode or ("cpu" if runner.device.type == "cpu" else "device")
        if self.mask_mode not in ("cpu", "device"):
            raise ParamError(f"mask_mode must be 'cpu' or 'device', got {self.mask_mode!r}")

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
        if request_id in self._groups:
            raise ParamError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_request(prompt_ids, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = _Group(request_id, prompt_text, prompt_ids, params, RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, prompt_ids, params, arrival_time=now)
            seq = _Sequence(
                req=req,
                group=group,
                index=i,
                stop=StopChecker(self.tokenizer, prompt_ids, params, self.max_model_len, self.eos_token_ids),
                generator=self._generator(params, i),
                logprobs=[] if params.logprobs is not None else None,
            )
            group.seqs.append(seq)
            self._seqs[seq_id] = seq
        so = params.structured_outputs
        if so is not None:
            try:
                for seq in group.seqs:
                    self.guidance.submit(seq.req, so)
            except ParamError:
                for seq in group.seqs:
                    self.guidance.release(seq.req.request_id)
                    self._seqs.pop(seq.req.request_id, None)
                raise
        self._groups[request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq.req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed. Unknown ids are ignored."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.req.is_finished:
                self.scheduler.abort(seq.req.request_id)
                seq.req.status = RequestStatus.FINISHED_ABORTED
        self._release(group)

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
        """A request's own generator: seeded requests sample the same whatever else is in the batch."""
        if params.seed is None:
            return None
        return torch.Generator(self.runner.device).manual_seed(params.seed + index)

    # -------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that progressed (cumulative, vLLM-style)."""
        if self.guidance.has_pending:
            self._poll_grammars()
        t_draft = time.perf_counter()
        running = self.scheduler.running
        if self.spec is not None:
            self.spec.draft(running, self._max_drafts)
        self.guidance.constrain_drafts(running, self._max_drafts)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty():
            if self.guidance.has_pending:
                time.sleep(0.002)  # only grammar compiles are outstanding: let them run
            return self._drain_errors()
        handle = self.runner.launch(plan)
        t1 = time.perf_counter()
        # CPU work overlapped with the forward: grammar bitmasks for this step, drafts for the next one.
        masks = self.guidance.fill(plan)
        if self.spec is not None:
            self.spec.start_lookahead([self._seqs[sr.request_id].req for sr in plan.requests if sr.num_draft_tokens])
        t2 = time.perf_counter()
        logits = self.runner.collect(handle)  # [R, V]
        t3 = time.perf_counter()
        if masks.plain is not None or masks.spec is not None:
            self.guidance.stats.exposed_s += max(0.0, t2 - handle.finished_at)
        new_tokens = self.runner.on_forward_thread(self._sample, plan, logits, masks)
        t4 = time.perf_counter()
        outputs = self._advance(plan, new_tokens)
        s = self.stats
        s.num_steps += 1
        s.draft_s += t0 - t_draft
        s.forward_s += t3 - t1 + (t1 - t0)
        s.cpu_overlap_s += t2 - t1
        s.sample_s += t4 - t3
        s.num_preemptions += len(plan.preempted_ids)
        if self.spec is not None:
            self.spec.observe_step(plan.num_tokens, t3 - t0, t0 - t_draft)
        return outputs + self._drain_errors()

    def _max_drafts(self, req: Request) -> int:
        """Drafts this request may take: every emitted token must fit max_tokens and max_model_len."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            return 0
        limit = self.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            limit = min(limit, req.params.max_tokens - req.num_output_tokens)
        return max(0, limit - 1)

    def _poll_grammars(self) -> None:
        ready, failed = self.guidance.poll()
        for rid, backend in ready:
            seq = self._seqs.get(rid)
            if seq is not None:
                seq.req.hold_sampling = False
                seq.group.metrics.grammar_backend = backend
        for rid, reason in failed:
            seq = self._seqs.get(rid)
            if seq is not None:
                self._fail(seq, reason)

    def _fail(self, seq: _Sequence, reason: str) -> None:
        """End one sequence with an error (its group reports it); the rest of the batch is untouched."""
        self.scheduler.abort(seq.req.request_id)
        seq.req.status = RequestStatus.FINISHED_ERROR
        seq.group.error = reason
        if seq.group.finished:
            self._finished_errors.append(self._output(seq.group))
            self._release(seq.group)

    def _bitmask(self, mask: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
        return None if mask is None else torch.from_numpy(mask).to(device, non_blocking=True)

    def _sample(self, plan: StepPlan, logits: torch.Tensor, masks: StepMasks) -> dict[str, list[int]]:
        """Tokens per request that reached the end of its known tokens: sampled, or drafts verified; logprobs."""
        if self.mask_mode == "cpu" and logits.device.type != "cpu" and (masks.plain is not None or masks.spec is not None):
            logits = logits.cpu()  # mode (b): all logits processing and sampling on the host
        plain: list[tuple[_Sequence, int]] = []  # (sequence, logits row)
        spec: list[tuple[_Sequence, int, list[int]]] = []  # (sequence, first row, drafts)
        offset = 0
        for sr in plan.requests:
            seq = self._seqs[sr.request_id]
            n = sr.num_logits_rows
            if sr.all_logits:
                self._record_prompt_logprobs(seq, sr, logits[offset : offset + n])
            if sr.needs_logits:
                k = sr.num_draft_tokens
                if k:
                    spec.append((seq, offset + n - 1 - k, sr.input_ids[-k:]))
                else:
                    plain.append((seq, offset + n - 1))
            offset += n
        tokens: dict[str, list[int]] = {}
        if plain:
            rows = [self._row(seq, ()) for seq, _ in plain]
            picked = [r for _, r in plain]
            if picked == list(range(logits.shape[0])):  # every row, in order (plain decode): no copy
                x = logits
            else:
                x = logits.index_select(0, torch.tensor(picked, device=logits.device))
            out = self.sampler.sample(x, rows, self._bitmask(masks.plain, logits.device))
            for (seq, _), tok, lp in zip(plain, out.token_ids, out.logprobs):
                tokens[seq.req.request_id] = [tok]
                self._add_logprobs(seq, [lp] if lp is not None else [])
        if spec:
            tokens.update(self._verify(spec, logits, self._bitmask(masks.spec, logits.device)))
        return tokens

    def _row(self, seq: _Sequence, drafts: Sequence[int]) -> SamplingRow:
        req = seq.req
        out = req.output_token_ids
        return SamplingRow(req.params, req.prompt_token_ids, out + list(drafts) if drafts else out, seq.generator)

    def _verify(
        self, spec: list[tuple[_Sequence, int, list[int]]], logits: torch.Tensor, bitmask: torch.Tensor | None
    ) -> dict[str, list[int]]:
        """Rejection-sample every speculative request's drafts in one call (row j sees drafts[:j] as its history)."""
        row_idx = [first + j for _, first, d in spec for j in range(len(d) + 1)]
        rows = [self._row(seq, d[:j]) for seq, _, d in spec for j in range(len(d) + 1)]
        target = logits.index_select(0, torch.tensor(row_idx, device=logits.device))  # [sum(k + 1), V]
        emitted = rejection_sample(self.sampler, target, rows, [DraftRows(d, None) for _, _, d in spec], bitmask)
        tokens: dict[str, list[int]] = {}
        pos = 0
        for (seq, _, drafts), toks in zip(spec, emitted):
            tokens[seq.req.request_id] = toks
            if seq.logprobs is not None:
                n = seq.req.params.logprobs or 0
                self._add_logprobs(seq, prompt_logprobs(target[pos : pos + len(toks)], toks, n))
            pos += len(drafts) + 1
        return tokens

    def _add_logprobs(self, seq: _Sequence, lps: Sequence[RowLogprobs]) -> None:
        if seq.logprobs is None:
            return
        for lp in lps:
            seq.logprobs.append(self._logprob_dict(lp))
            seq.cumulative_logprob += lp.logprob

    def _record_prompt_logprobs(self, seq: _Sequence, sr: ScheduledRequest, logits: torch.Tensor) -> None:
        """Row i predicts the token at position start + i + 1; record those inside the prompt (first sequence only).

        Keyed by position: after a preemption the prompt is recomputed and rows already recorded are skipped.
        """
        group = seq.group
        if seq.index != 0 or group.prompt_logprobs is None:
            return
        prompt = group.prompt_token_ids
        first = len(group.prompt_logprobs)  # next position without a record
        rows = [i for i in range(sr.num_tokens) if first <= sr.start_pos + i + 1 < len(prompt)]
        if not rows:
            return
        nexts = [prompt[sr.start_pos + i + 1] for i in rows]
        top_n = seq.req.params.prompt_logprobs or 0
        for lp in prompt_logprobs(logits[rows[0] : rows[-1] + 1], nexts, top_n):
            group.prompt_logprobs.append(self._logprob_dict(lp))

    def _logprob_dict(self, lp: RowLogprobs) -> dict[int, Logprob]:
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id], skip_special_tokens=False))}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if t not in d:
                d[t] = Logprob(v, rank, self.tokenizer.decode([t], skip_special_tokens=False))
        return d

    def _advance(self, plan: StepPlan, new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        """Cut new tokens at stop conditions, advance the scheduler, finish what ended; outputs of touched groups."""
        finished: dict[str, RequestStatus] = {}  # one final status per sequence
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        for rid, toks in new_tokens.items():
            seq = self._seqs[rid]
            try:
                decision = seq.stop.add_tokens(toks)
            except Exception as e:  # noqa: BLE001 - one broken request must not take the batch down
                logger.exception("request %s failed while detokenizing", rid)
                seq.group.error = f"{type(e).__name__}: {e}"
                finished[rid] = RequestStatus.FINISHED_ERROR
                touched[seq.group.request_id] = seq.group
                continue
            kept = toks[: decision.num_tokens_kept]
            new_tokens[rid] = kept
            if self.spec is not None and not self.guidance.drafts_were_forced(rid):
                drafts = seq.req.draft_token_ids
                seq.group.metrics.num_draft_tokens += len(drafts)
                seq.group.metrics.num_accepted_tokens += self.spec.observe(seq.req, drafts, toks)
            if seq.logprobs is not None and len(kept) < len(toks):
                del seq.logprobs[len(seq.logprobs) - (len(toks) - len(kept)) :]
            terminated, grammar_error = self.guidance.accept(seq.req, kept, len(seq.req.draft_token_ids))
            if decision.finished:  # ends normally; the matcher's view of its last token no longer matters
                finished[rid] = RequestStatus.FINISHED_STOPPED if decision.reason == "stop" else RequestStatus.FINISHED_LENGTH
                seq.req.stop_reason = decision.stop_reason
            elif grammar_error is not None:
                seq.group.error = grammar_error
                finished[rid] = RequestStatus.FINISHED_ERROR
            elif terminated:
                finished[rid] = RequestStatus.FINISHED_STOPPED
            if seq.group.metrics.first_token_time is None:
                seq.group.metrics.first_token_time = now
            touched[seq.group.request_id] = seq.group
        self.scheduler.update(plan, new_tokens)
        for rid, status in finished.items():
            if self.scheduler.get(rid) is not None:
                self.scheduler.finish(rid, status)
            self._seqs[rid].req.status = status
        self.stats.num_generated_tokens += sum(len(t) for t in new_tokens.values())
        self.stats.num_prompt_tokens += sum(sr.num_tokens - sr.num_draft_tokens for sr in plan.requests if sr.is_prefill)
        outputs = [self._output(g) for g in touched.values()]
        for g in touched.values():
            if g.finished:
                g.metrics.finished_time = now
                self._release(g)
        return outputs

    def _output(self, group: _Group) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.stop.text if s.req.is_finished else s.stop.visible_text(),
                token_ids=s.req.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.req.status.finish_reason,
                stop_reason=s.req.stop_reason,
            )
            for s in group.seqs
        ]
        group.metrics.num_cached_tokens = max(s.req.num_cached_tokens for s in group.seqs)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            prompt_logprobs=group.prompt_logprobs,
            metrics=group.metrics,
            error=group.error,
        )

    def _release(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for s in group.seqs:
            self._seqs.pop(s.req.request_id, None)
            if self.spec is not None:
                self.spec.release(s.req.request_id)
            self.guidance.release(s.req.request_id)

    def _drain_errors(self) -> list[RequestOutput]:
        out, self._finished_errors = self._finished_errors, []
        return out

    def shutdown(self) -> None:
        """Abort what runs, stop the draft worker, the grammar pools and the forward thread."""
        for rid in list(self._groups):
            self.abort_request(rid)
        if self.spec is not None:
            self.spec.close()
        self.guidance.shutdown()
        self.runner.shutdown()

    def get_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": bm.usage,
            "kv_num_blocks": self.runner.num_blocks,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            **self.stats.__dict__,
            **(self.spec.stats.as_dict() if self.spec is not None else {}),
            **self.guidance.stats.as_dict(),
            **(self.cpu_budget.as_dict() if self.cpu_budget is not None else {}),
            **({"grammar_" + k: v for k, v in self.guidance.manager.stats().items()} if self.guidance._manager else {}),
        }
