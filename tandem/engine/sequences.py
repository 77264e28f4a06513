"""The engine's per-request records: a user request (`RequestGroup`) and its `n` sequences (`SequenceState`), and
how they become the cumulative `RequestOutput` the user sees."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.stop import StopChecker
from tandem.params import SamplingParams
from tandem.request import CompletionOutput, Logprob, Request, RequestMetrics, RequestOutput


@dataclass(eq=False)
class SequenceState:
    """Engine-side extras of one scheduled sequence (one of a request's `n` completions)."""

    req: Request
    group: RequestGroup
    index: int
    stop: StopChecker
    generator: torch.Generator | None  # the request's own generator when it has a seed
    logprobs: list[dict[int, Logprob]] | None  # per generated position, when logprobs were asked for
    cumulative_logprob: float = 0.0

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass(eq=False)
class RequestGroup:
    """One user request: its prompt and its `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's cumulative output so far (visible text only while a sequence runs)."""
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.stop.text if s.req.is_finished else s.stop.visible_text(),
                token_ids=s.req.confirmed_output_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.req.status.finish_reason,
                stop_reason=s.req.stop_reason,
            )
            for s in self.seqs
        ]
        self.metrics.num_cached_tokens = max(s.req.num_cached_tokens for s in self.seqs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
            error=self.error,
        )
