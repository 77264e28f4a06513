"""The drafting contract: what the engine hands a proposer each step and what it gets back.

A proposer guesses the next tokens of each running request on the CPU while the accelerator is busy; the target
model verifies the guesses in its next forward pass. Proposers are built by name from `registry.PROPOSERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class DraftRequest:
    """One request's drafting job for this step (plain data).

    `token_ids` is prompt + output so far; proposers treat it as a read-only view and copy only the tokens they
    have not seen yet, never the whole list per step.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_drafts: int  # K for this request this step; 0 = do not draft
    # tokens taken to follow `token_ids` that are not known yet (the drafts of a step still verifying, then a
    # guess): draft the positions after them, but learn only `token_ids` (they may still be rejected)
    assumed: Sequence[int] = ()


@dataclass
class Drafts:
    """A proposal for the positions right after `token_ids` (+ `assumed`): at most max_drafts tokens, possibly none.

    Drafts are deterministic guesses (the proposal distribution is one-hot), which keeps verification lossless with
    the rule in sampling/rejection.py.
    """

    token_ids: list[int]


class Proposer(ABC):
    """A speculative drafter. Every call is made from the engine's thread, between or during device steps."""

    name: str
    # The proposer drafts on other threads or processes while the device verifies (`propose_async` returns before
    # the drafts exist). It then shares the host's cores with the target's forward, so its cost shows only in wall
    # time: the engine drafts the next step ahead of verification and measures goodput with and without drafting.
    drafts_concurrently: bool = False

    @abstractmethod
    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        """Draft for every request of `batch`; the result has one entry per request id (empty when K = 0).

        May update the proposer's per-request state with the tokens of `token_ids` it has not seen yet.
        """

    @abstractmethod
    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        """Report verification: `accepted` is the accepted prefix of the last `num_drafted` drafts."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state (a proposer may first learn from its output)."""

    def tidy(self, deadline: float | None) -> None:  # noqa: B027 - optional: most proposers defer nothing
        """Work `release` deferred (e.g. learning from a finished request's output), done now: as much as fits
        before `deadline` (perf_counter), all of it when None. The engine calls it where its thread would otherwise
        wait for the device, so that the work stays off the steps whose host work already fills a forward."""

    def propose_async(self, batch: Sequence[DraftRequest]) -> Future[dict[str, Drafts]]:
        """Start drafting for `batch`; the future holds what `propose` returns. Synchronous unless overridden."""
        done: Future[dict[str, Drafts]] = Future()
        done.set_result(self.propose(batch))
        return done

    def close(self) -> None:  # noqa: B027 - optional: most proposers hold nothing to stop
        """Stop worker threads or processes (idempotent)."""
