"""Turning one step's logits into tokens: sample the plain rows, verify the drafted rows, record logprobs.

Runs on the tensor thread (`ModelRunner.on_tensor_thread`); reads the sequences' state, writes only their logprob
records. Row order: the plan's requests in order, each with its `num_logits_rows` rows (see core/plan.py).
`prepare` makes a step's rows as sampling takes them before its logits exist (scheduling ahead: while its forward
runs), so that after the forward only the tensor work and the tokens' bookkeeping are left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import overload

import numpy as np
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.engine.guidance import StepMasks
from tandem.engine.sequences import SequenceState
from tandem.params import SamplingParams
from tandem.request import Logprob
from tandem.sampling.rejection import DraftRows, greedy_verify, rejection_sample
from tandem.sampling.sampler import (
    RowLogprobs,
    Sampler,
    SamplingRow,
    keyed_generator,
    only_greedy,
    prompt_logprobs,
)
from tandem.tokenizer import Tokenizer

# (sequence, or None when it ended meanwhile; logits row; the number of its tokens before the sampled one)
PlainRow = tuple[SequenceState | None, int, int]
_UNUSED = SamplingRow(SamplingParams(temperature=0.0), [], [], None)  # the row of a sequence that ended meanwhile
# (sequence, or None when it ended meanwhile; first logits row; drafts; tokens before them)
VerifyRows = tuple[SequenceState | None, int, list[int], int]
# a sequence's tokens of this step -> those it emits (a prefix, its last one possibly replaced: engine/thinking.py)
Limit = Callable[[SequenceState, list[int]], list[int]]


def _unlimited(seq: SequenceState, tokens: list[int]) -> list[int]:
    return tokens


@dataclass
class StagedMasks:
    """A step's bitmasks where sampling will read them: on the device (copied from pinned memory, non-blocking,
    while the forward still runs) or on the host (mode (b), or a CPU device: no copy)."""

    sample_rows: torch.Tensor | None  # [n_sampled_rows, W] int32
    verify_rows: torch.Tensor | None  # [n_verify_rows, W] int32

    @property
    def guided(self) -> bool:
        return self.sample_rows is not None or self.verify_rows is not None


@dataclass(frozen=True)
class RowGroup:
    """Logits rows sampled (or verified) in one call: which, their sampling rows, whether all are greedy."""

    index: list[int]  # the rows of the step's logits, in order
    rows: list[SamplingRow]  # one per index
    all_greedy: bool  # `only_greedy(rows)`


@dataclass(frozen=True)
class SampleRows:
    """A step's logits rows as sampling takes them (`StepSampler.prepare`), made before its logits exist."""

    plan: StepPlan
    plain: list[PlainRow]
    verify: list[VerifyRows]
    record: list[tuple[SequenceState, int, ScheduledRequest]]  # (sequence, first logits row, row): prompt logprobs
    plain_group: RowGroup
    verify_group: RowGroup  # k + 1 rows per `verify` entry, in order


class StepSampler:
    """Samples or verifies every sequence of a step that reached the end of its known tokens."""

    def __init__(self, sampler: Sampler, tokenizer: Tokenizer, mask_mode: str, device: torch.device,
                 limit: Limit = _unlimited) -> None:
        """`limit`: what a sequence emits of the tokens sampled for it (a thinking's end, a spent budget's forced
        token), applied before their logprobs are recorded: one entry per emitted token, a forced one's its own."""
        self.sampler = sampler
        self.limit = limit
        self.tokenizer = tokenizer
        # (a) "device": bitmask copied to the device and applied there; (b) "cpu": logits brought to the host
        self.mask_mode = mask_mode
        self.device = device
        self.failures: dict[str, str] = {}  # request -> why it got no token in the last `sample`
        self._buffers: dict[str, torch.Tensor] = {}  # the buffers the grammar fills (page-locked for an accelerator)

    # ------------------------------------------------------------------------------------------ grammar masks
    def mask_buffer(self, kind: str, rows: int, words: int) -> np.ndarray:
        """An int32 [rows, words] array, every bit set, for the grammar to fill: a view of page-locked memory when
        the masks go to an accelerator (so `stage` copies without a stop), else of a host buffer kept per kind (a
        fresh 6 MB array per step, 256 rows over o200k, cost its page faults: ~1 ms of the engine thread).

        A buffer is reused by the next step's fill: by then the copy has been consumed (sampling reads it, and the
        engine waits for sampling's tokens) in both the synchronous and the scheduling-ahead step."""
        pinned = self.device.type != "cpu" and self.mask_mode != "cpu"
        buf = self._buffers.get(kind)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            buf = self._buffers[kind] = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=pinned)
        view = buf[:rows].numpy()
        view.fill(-1)
        return view

    def stage(self, masks: StepMasks) -> StagedMasks:
        """Start the copies of a step's bitmasks to where sampling runs (call as soon as they are filled)."""
        to_device = self.device.type != "cpu" and self.mask_mode == "device"

        def put(mask: np.ndarray | None) -> torch.Tensor | None:
            if mask is None:
                return None
            t = torch.from_numpy(mask)
            return t.to(self.device, non_blocking=True) if to_device else t

        return StagedMasks(put(masks.sample_rows), put(masks.verify_rows))

    # ------------------------------------------------------------------------------------------------ sampling
    def prepare(self, plan: StepPlan, seqs: Mapping[str, SequenceState]) -> SampleRows:
        """`plan`'s rows split into sampled and verifying ones, each with its sampling row (params, history), before
        its logits exist: called while its forward runs, this Python is off the path from the forward's end to the
        sampling's kernels, where an accelerator idles for it (at 256 rows with drafts, ~0.4 ms a step on the host:
        AMD EPYC Zen 4, 2026-12-07). Valid until the sequences change: the engine changes them only after sampling."""
        plain, verify, record = self._split_rows(plan, seqs)
        return SampleRows(plan, plain, verify, record, _plain_group(plain), _verify_group(verify))

    def sample(self, plan: StepPlan, logits: torch.Tensor, masks: StagedMasks, seqs: Mapping[str, SequenceState],
               prepared: SampleRows | None = None) -> dict[str, list[int]]:
        """Tokens per request id: one sampled token, or the verified drafts plus one. logits: [R, V]. `prepared`:
        `prepare(plan, seqs)` made since the sequences last changed (else made now).

        A request that reached a row where no token was allowed (its grammar, min_tokens, stop ids, allowed ids and
        logit bias exclude every token) gets only the drafts accepted before that row; `failures` says why, until the
        next call."""
        self.failures = {}
        if self.mask_mode == "cpu" and logits.device.type != "cpu" and masks.guided:
            logits = logits.cpu()  # mode (b): all logits processing and sampling on the host
        rows = prepared if prepared is not None and prepared.plan is plan else self.prepare(plan, seqs)
        for seq, first, sr in rows.record:
            self._record_prompt_logprobs(seq, sr, logits[first : first + sr.num_logits_rows])
        tokens: dict[str, list[int]] = {}
        if rows.plain:
            tokens.update(self._sample_plain(rows.plain, logits, _on(masks.sample_rows, logits.device), rows.plain_group))
        if rows.verify:
            tokens.update(self._verify(rows.verify, logits, _on(masks.verify_rows, logits.device), rows.verify_group))
        return tokens

    def _split_rows(
        self, plan: StepPlan, seqs: Mapping[str, SequenceState]
    ) -> tuple[list[PlainRow], list[VerifyRows], list[tuple[SequenceState, int, ScheduledRequest]]]:
        """Which rows are sampled and which verify drafts, and the rows whose prompt logprobs are recorded (the
        sequence, its first logits row, its scheduled row)."""
        plain: list[PlainRow] = []
        verify: list[VerifyRows] = []
        record: list[tuple[SequenceState, int, ScheduledRequest]] = []
        offset = 0
        for sr in plan.requests:
            seq = seqs.get(sr.request_id)
            n = sr.num_logits_rows
            if seq is None or seq.req.is_finished:  # ended while its plan ran (scheduling ahead): sampled, unused
                k = sr.num_draft_tokens  # (in the row order its bitmask rows were filled in)
                if sr.needs_logits and k:
                    verify.append((None, offset + n - 1 - k, sr.input_ids[-k:], 0))
                elif sr.needs_logits:
                    plain.append((None, offset + n - 1, 0))
                offset += n
                continue
            if sr.all_logits:
                record.append((seq, offset, sr))
            if sr.needs_logits:  # known: the tokens before the row's drafts (a recomputed prefill's: all it fed)
                k = sr.num_draft_tokens
                known = sr.start_pos + sr.num_tokens - k
                if k:
                    verify.append((seq, offset + n - 1 - k, sr.input_ids[-k:], known))
                else:
                    plain.append((seq, offset + n - 1, known))
            offset += n
        return plain, verify, record

    def _sample_plain(self, plain: list[PlainRow], logits: torch.Tensor, bitmask: torch.Tensor | None,
                      group: RowGroup | None = None) -> dict[str, list[int]]:
        """Sample the `plain` rows of `logits` (`group`: `_plain_group(plain)`, when made ahead)."""
        group = group or _plain_group(plain)
        in_order = group.index == list(range(logits.shape[0]))  # every row, in order (plain decode)
        index = None if in_order else torch.tensor(group.index, device=logits.device)
        out = self.sampler.sample(logits, group.rows, bitmask, group.all_greedy, index)
        tokens: dict[str, list[int]] = {}
        dead = set(out.dead_rows)
        for i, ((seq, row, _), tok, lp) in enumerate(zip(plain, out.token_ids, out.logprobs)):
            if seq is None:
                continue
            if i in dead:
                tokens[seq.request_id] = []
                self._no_token(seq, 0)
                continue
            toks = tokens[seq.request_id] = self.limit(seq, [tok])
            if lp is not None:
                if toks[0] != tok:  # forced in its place: the forced token's logprob, from the same row
                    lp = prompt_logprobs(logits[row : row + 1], toks, seq.req.params.logprobs or 0)[0]
                self._add_logprobs(seq, [lp])
        return tokens

    def sample_masked(self, rows: Mapping[str, int], logits: torch.Tensor, mask: np.ndarray,
                      seqs: Mapping[str, SequenceState], request_ids: Sequence[str]) -> dict[str, list[int]]:
        """Sample again the rows of `request_ids` (in that order; `rows`: request id -> its row of `logits`), each
        with its row of `mask` [n, W] int32 (rows first sampled without one). Dead rows are added to `failures`."""
        plain: list[PlainRow] = [(seq, rows[rid], _known(seq)) for rid in request_ids for seq in [seqs.get(rid)]]
        return self._sample_plain(plain, logits, torch.from_numpy(mask).to(logits.device))

    def verify_masked(self, plan: StepPlan, logits: torch.Tensor, mask: np.ndarray, seqs: Mapping[str, SequenceState],
                      request_ids: Sequence[str]) -> dict[str, list[int]]:
        """Verify again the drafts of `request_ids` (live requests of `plan`, first verified without masks), with
        `mask` [sum(k + 1), W] int32: their rows in that order. Dead rows are added to `failures`."""
        verify = self._split_rows(plan, seqs)[1]
        mine = {v[0].request_id: v for v in verify if v[0] is not None}
        return self._verify([mine[rid] for rid in request_ids], logits, torch.from_numpy(mask).to(logits.device))

    def _no_token(self, seq: SequenceState, num_accepted: int) -> None:
        """Record why `seq` got no token after its first `num_accepted` new ones: the constraints that were in force."""
        p, done = seq.req.params, len(seq.req.confirmed_output_ids) + num_accepted
        causes = ["the grammar"] if p.structured_outputs is not None else []
        if done < p.min_tokens:
            causes.append(f"min_tokens={p.min_tokens} (EOS and stop_token_ids are banned before {p.min_tokens} "
                          f"tokens; {done} so far)")
        if p.allowed_token_ids is not None:
            causes.append("allowed_token_ids")
        if p.logit_bias and any(b == float("-inf") for b in p.logit_bias.values()):
            causes.append("logit_bias")
        self.failures[seq.request_id] = f"no token is allowed here: {' and '.join(causes) or 'the constraints'} " \
                                        "exclude every token"

    def _verify(self, verify: list[VerifyRows], logits: torch.Tensor, bitmask: torch.Tensor | None,
                group: RowGroup | None = None) -> dict[str, list[int]]:
        """Rejection-sample every speculative request's drafts in one call (row j sees drafts[:j] as its history;
        `group`: `_verify_group(verify)`, when made ahead)."""
        group = group or _verify_group(verify)
        draft_rows = [DraftRows(d, None) for _, _, d, _ in verify]
        index = torch.tensor(group.index, device=logits.device)
        logprobs = any(seq is not None and seq.logprobs is not None for seq, _, _, _ in verify)
        # greedy on the host: the rows read where they are (copying ~770 rows of 49k tokens took 2-4 ms a step)
        emitted = None if logprobs else greedy_verify(self.sampler, logits, index, group.rows, draft_rows, bitmask,
                                                      group.all_greedy)
        target = logits
        if emitted is None:
            target = logits.index_select(0, index)  # [sum(k + 1), V]
            emitted = rejection_sample(self.sampler, target, group.rows, draft_rows, bitmask, group.all_greedy)
        tokens: dict[str, list[int]] = {}
        pos = 0
        for (seq, _, drafts, _), (toks, dead) in zip(verify, emitted):
            if seq is None:  # a sequence that ended meanwhile: verified, unused
                pos += len(drafts) + 1
                continue
            if dead:
                self._no_token(seq, len(toks))
            toks = tokens[seq.request_id] = self.limit(seq, toks)
            if toks and seq.logprobs is not None:
                n = seq.req.params.logprobs or 0
                self._add_logprobs(seq, prompt_logprobs(target[pos : pos + len(toks)], toks, n))
            pos += len(drafts) + 1
        return tokens

    def _add_logprobs(self, seq: SequenceState, lps: Sequence[RowLogprobs]) -> None:
        if seq.logprobs is None:
            return
        for lp in lps:
            seq.logprobs.append(self._logprob_dict(lp))
            seq.cumulative_logprob += lp.logprob

    def _record_prompt_logprobs(self, seq: SequenceState, sr: ScheduledRequest, logits: torch.Tensor) -> None:
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


def plain_rows(plan: StepPlan) -> dict[str, int]:
    """Request id -> its logits row, for the requests of `plan` sampled directly (no drafts to verify)."""
    rows: dict[str, int] = {}
    offset = 0
    for sr in plan.requests:
        offset += sr.num_logits_rows
        if sr.needs_logits and not sr.num_draft_tokens:
            rows[sr.request_id] = offset - 1
    return rows


class OutputHistory(Sequence[int]):
    """A row's output history, `tokens[start:stop]` then `drafts`, read in place: a row is made for every logits row
    of every request each step, and only a row with penalties reads its tokens (min_tokens reads the length).
    Copied, at 256 requests with 2 drafts each, 768 rows took 0.40 ms a step at 48 output tokens, 2.5 at 500, 8.7-11
    at 2,000 and 35-37 at 8,000; read in place 0.44 at any length (AMD EPYC Zen 4, 2026-12-07). Valid while the
    request's token list is unchanged: within one `sample` call (the engine changes its requests only after sampling
    returns)."""

    __slots__ = ("_tokens", "_start", "_stop", "_drafts")

    def __init__(self, tokens: Sequence[int], start: int, stop: int, drafts: Sequence[int] = ()) -> None:
        self._tokens, self._start, self._stop, self._drafts = tokens, start, max(start, stop), drafts

    def __len__(self) -> int:
        return self._stop - self._start + len(self._drafts)

    def __iter__(self) -> Iterator[int]:
        yield from islice(self._tokens, self._start, self._stop)
        yield from self._drafts

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return list(self)[i]
        n, held = len(self), self._stop - self._start
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError("output history index out of range")
        return self._tokens[self._start + j] if j < held else self._drafts[j - held]


def _plain_group(plain: list[PlainRow]) -> RowGroup:
    """The sampled rows' group: a row each."""
    rows = [_row(seq, known, ()) if seq is not None else _UNUSED for seq, _, known in plain]
    return RowGroup([r for _, r, _ in plain], rows, only_greedy(rows))


def _verify_group(verify: list[VerifyRows]) -> RowGroup:
    """The verifying rows' group: k + 1 rows a request, row j with drafts[:j] in its history."""
    rows = [_row(seq, known, d[:j]) if seq is not None else _UNUSED
            for seq, _, d, known in verify for j in range(len(d) + 1)]
    return RowGroup([first + j for _, first, d, _ in verify for j in range(len(d) + 1)], rows, only_greedy(rows))


def _row(seq: SequenceState, known: int, drafts: Sequence[int]) -> SamplingRow:
    """The sampling row of `seq` after its first `known` tokens and `drafts`: its output history is those alone,
    not the tentative tail of plans scheduled ahead (placeholders, drafts not verified yet)."""
    req = seq.req
    history = OutputHistory(req.token_ids, req.num_prompt_tokens, known, drafts)
    # (a greedy row draws nothing: no generator made for it, on the path of every row of every step)
    generator = keyed_generator(seq.generator, len(history)) if seq.generator is not None and not req.params.greedy else None
    return SamplingRow(req.params, req.prompt_token_ids, history, generator)


def _known(seq: SequenceState | None) -> int:
    """`seq`'s confirmed tokens (a row sampled again: its placeholder is the first tentative token)."""
    return 0 if seq is None else len(seq.req.token_ids) - seq.req.num_tentative


def _on(mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The staged mask on the logits' device (already there unless the logits moved, as in mode (b))."""
    return None if mask is None else mask.to(device, non_blocking=True)
