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

`NoSpeculation` is the same interface doing nothing: the engine's step never asks whether speculation is on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tandem.request import Request
from tandem.spec_decode.adaptive import AdaptiveK
from tandem.spec_decode.config import SpeculativeConfig
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer

logger = logging.getLogger("tandem")
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
            "spec_num_drafted": self.num_drafted,
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 3),
            "spec_acceptance_per_position": [round(x, 3) for x in per_pos],
            "spec_draft_wait_s": round(self.draft_wait_s, 4),
            "spec_lookahead_s": round(self.lookahead_s, 4),
            "spec_lookahead_hits": self.lookahead_hits,
            "spec_lookahead_misses": self.lookahead_misses,
            "spec_draft_errors": self.draft_errors,
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
    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        """Learn one verification of `drafts` that emitted `emitted`; returns how many drafts were accepted."""

    @abstractmethod
    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float) -> None:
        """Learn one step's cost: tokens run, forward seconds, seconds the device waited for drafting."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The request ended: drop its drafting state."""

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

    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        return 0

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def stats_dict(self) -> dict[str, Any]:
        return {}


@dataclass
class _Ahead:
    """Drafts proposed ahead of time for one request: `future` continues `token_ids[:base] + assumed`."""

    base: int  # len(token_ids) when the proposal was started
    assumed: list[int]  # the tokens it assumed would follow (drafts + guess); [] for a proposal on the context then
    future: Future[dict[str, Drafts]]


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

    # ------------------------------------------------------------------------------------------------ drafting
    def draft(self, running: Sequence[Request], allowed: MaxDrafts) -> None:
        """Set `draft_token_ids` of every running request in steady decode. `allowed(req)` caps K for that request."""
        t0 = time.perf_counter()
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and not r.is_finished]
        batch: list[DraftRequest] = []
        restart: list[DraftRequest] = []
        ks: dict[str, int] = {}
        for req in decoding:
            rid = req.request_id
            k = ks[rid] = min(self._choose_k(rid, len(decoding)), allowed(req))
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

    def _propose_ahead(self, batch: list[DraftRequest], assumed: dict[str, list[int]]) -> None:
        """Start one proposal for `batch` (each request's tokens + `assumed[rid]`) and remember it per request."""
        future = self.proposer.propose_async(batch)
        for dr in batch:
            a = assumed[dr.request_id]
            self._ahead[dr.request_id] = _Ahead(len(dr.token_ids) - len(a), a, future)

    # ------------------------------------------------------------------------------------------------ learning
    def observe(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        """Learn one verification; returns how many drafts were accepted."""
        k = len(drafts)
        accepted = 0
        while accepted < min(k, len(emitted) - 1) and emitted[accepted] == drafts[accepted]:
            accepted += 1
        if self.adaptive is not None:
            self.adaptive.observe_emitted(len(emitted))
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

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float) -> None:
        self.stats.num_steps += 1
        if self.adaptive is not None:
            self.adaptive.observe_step(num_tokens, seconds, draft_seconds)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
        if self.adaptive is not None:
            self.adaptive.release(request_id)
        self._guess.pop(request_id, None)
        self._ahead.pop(request_id, None)

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
