"""Per-request state on the CPU (plain Python) and the outputs handed to users (vLLM-shaped)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from tandem.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # whether a request in this status has ended: set on each member below, a plain attribute (asked of every
    # request several times a step: ~900 times a step at 256 requests; a property testing the member's membership
    # of a set took ~4x as long, the member's hash being a Python call)
    finished: bool

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
for _status in RequestStatus:
    _status.finished = _status in _FINISHED


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariants: `token_ids == prompt + outputs`; positions `[0, num_computed_tokens)` have valid KV in the blocks of
    `block_ids` (block i holds positions `[i * block_size, (i + 1) * block_size)`); `draft_token_ids` are proposals
    for the positions after `token_ids` and are not part of it until verified.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks of token_ids, in order
    draft_token_ids: list[int] = field(default_factory=list)
    # scheduling ahead: trailing tokens of token_ids not known yet, i.e. the placeholders of plans in flight and the
    # drafts they verify (optimistically taken as accepted); 0 in the synchronous step
    num_tentative: int = 0
    hold_sampling: bool = False  # e.g. its grammar is still compiling: prefill all but the last token, sample nothing
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def confirmed_tokens(self) -> ConfirmedTokens:
        """Prompt and outputs known for sure, as a live view (see `ConfirmedTokens`)."""
        return ConfirmedTokens(self)

    @property
    def confirmed_output_ids(self) -> list[int]:
        """The outputs known for sure: without the tentative tail of plans still in flight."""
        return self.token_ids[len(self.prompt_token_ids) : len(self.token_ids) - self.num_tentative]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_tokens(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)


class ConfirmedTokens(Sequence[int]):
    """A live, read-only view of a request's known tokens: `token_ids` without its tentative tail (scheduling
    ahead). Proposers learn from it, so they never take in a draft that may still be rejected."""

    __slots__ = ("_req",)

    def __init__(self, req: Request) -> None:
        self._req = req

    def __len__(self) -> int:
        return len(self._req.token_ids) - self._req.num_tentative

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            return self._req.token_ids[slice(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError(i)
        return self._req.token_ids[i % n]


@dataclass
class Logprob:
    """Log-probability of one token, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the sampled token plus the top-n).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # with a reasoning parser (`text` stays the whole output): the thinking text, markers left out (None: it did not
    # think), the answer after it (None while it thinks, or when it never stopped thinking), the thinking's tokens
    reasoning: str | None = None
    content: str | None = None
    num_reasoning_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_forced_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    grammar_backend: str | None = None
    grammar_backend_reason: str | None = None  # why that backend serves it (auto routes by cost)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, and what `LLMEngine.step` reports (cumulative so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for a process boundary or JSON)."""
        from dataclasses import asdict

        return asdict(self)
