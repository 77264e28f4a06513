"""The drafting contract: what the engine hands a proposer each step and what it gets back.

A proposer guesses the next tokens of each running request on the CPU while the accelerator is busy; the target
model verifies the guesses in its next forward pass. Proposers are looked up by name in `PROPOSERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


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


@dataclass
class Drafts:
    """A proposal for the positions right after `token_ids`."""

    token_ids: list[int]  # at most max_drafts, possibly empty
    probs: Any | None = None  # [k, V] proposal distribution for sampled verification; None = deterministic


class Proposer(Protocol):
    """A speculative drafter. Every call is made from the engine's thread, between or during device steps."""

    name: str

    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        """Draft for every request of `batch`; the result has one entry per request id (empty when K = 0).

        May update the proposer's per-request state with the tokens of `token_ids` it has not seen yet.
        """
        ...

    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        """Report verification: `accepted` is the accepted prefix of the last `num_drafted` drafts."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state (a proposer may first learn from its output)."""
        ...


# method name -> factory taking the method's keyword options. `tandem/spec/__init__.py` registers "ngram" and
# "suffix" (it always runs before this module is usable); other drafters (e.g. "draft_model") add themselves with
# `register_proposer`.
PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(method: str, factory: Callable[..., Proposer]) -> None:
    """Make `make_proposer(method, ...)` build proposers with `factory` (replaces an earlier registration)."""
    PROPOSERS[method] = factory


def make_proposer(method: str, **options: Any) -> Proposer:
    """Build the proposer registered as `method` with `options`; ValueError names the known methods."""
    factory = PROPOSERS.get(method)
    if factory is None:
        known = ", ".join(sorted(PROPOSERS)) or "none"
        raise ValueError(f"unknown speculative decoding method {method!r}; known methods: {known}")
    return factory(**options)
