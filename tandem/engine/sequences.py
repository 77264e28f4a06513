"""The engine's per-request records: a user request (`RequestGroup`) and its `n` sequences (`SequenceState`), and
how they become the cumulative `RequestOutput` the user sees."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.stop import StopChecker
from tandem.params import SamplingParams
from tandem.reasoning import ThinkingState
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
    thinking: ThinkingState | None = None  # with a reasoning parser

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def completion(self) -> CompletionOutput:
        """This sequence's cumulative output (visible text only while it runs), the thinking split off."""
        text = self.stop.text if self.req.is_finished else self.stop.visible_text()
        out = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.req.confirmed_output_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.req.status.finish_reason,
            stop_reason=self.req.stop_reason,
        )
        state = self.thinking
        if state is not None:
            marked = self.stop.marked_len
            if state.text_end is not None and marked is not None:
                out.reasoning, out.content = state.split_marked(text, marked)
            else:
                out.reasoning, out.content = state.split(text, self.req.is_finished)
            # the thinking is a prefix of the output: tokens the state was fed and a stop string (or the grammar's
            # end) then dropped, in a step of several (drafts), are not in the output and not counted
            out.num_reasoning_tokens = min(state.num_reasoning_tokens, len(out.token_ids))
        return out


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
        seqs = self.seqs
        if len(seqs) == 1:  # n = 1, asked of every request a step touches: no generator
            return seqs[0].req.is_finished
        return all(s.req.is_finished for s in seqs)

    def output(self) -> RequestOutput:
        """The request's cumulative output so far (visible text only while a sequence runs)."""
        completions = [s.completion() for s in self.seqs]
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
