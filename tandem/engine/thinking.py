"""Reasoning models inside the engine: each sequence's thinking followed token by token (`ThinkingState`), the end
marker forced when a thinking budget runs out, and the grammar started only once the thinking has ended.

Per step: `limit` as each sequence's tokens are sampled (the end marker is the last token of its step: later tokens
of a verified draft run are dropped, as a rejected draft's; a spent budget replaces the sampled token by the marker's
next one), then `feed` where the grammar takes the step's tokens (before the stop checks), which says from which
token on the grammar takes them. Rollback-safe by construction: the state only ever sees emitted tokens (confirmed,
never a draft or a tentative tail), so speculation and scheduling ahead need nothing else.
"""

from __future__ import annotations

from tandem.engine.guidance import Guidance
from tandem.engine.sequences import SequenceState
from tandem.reasoning import Reasoner


class Thinking:
    """The engine's reasoning part; without a reasoner every call is a no-op."""

    def __init__(self, reasoner: Reasoner | None, guidance: Guidance) -> None:
        self.reasoner = reasoner
        self._guidance = guidance

    def start(self, seq: SequenceState) -> None:
        """Give a new sequence its state, from its rendered prompt."""
        if self.reasoner is not None:
            seq.thinking = self.reasoner.start(seq.group.prompt_token_ids, seq.group.params.thinking_token_budget)

    def defer_grammar(self, seq: SequenceState, overlap_compile: bool) -> None:
        """A guided sequence that thinks first: its grammar waits for the end of the thinking. `overlap_compile`
        (the synchronous step, where the next plan is made after this step's tokens are known): it thinks while its
        grammar compiles instead of waiting for it, and is held only if the thinking ends first. A grammar that holds
        the thinking too (`enable_in_reasoning`) starts at the first token, as without a reasoner."""
        so = seq.group.params.structured_outputs
        if seq.thinking is not None and seq.thinking.thinking and not (so is not None and so.enable_in_reasoning):
            self._guidance.defer(seq.request_id)
            if overlap_compile:
                seq.req.hold_sampling = False

    def limit(self, seq: SequenceState, tokens: list[int]) -> list[int]:
        """What `seq` emits of the tokens just sampled for it (`StepSampler`'s `limit`, before their logprobs are
        recorded): while it thinks, cut after the end of its thinking, or its forced end-marker token in place of
        the sampled one; otherwise `tokens`."""
        if self.reasoner is None or not tokens or seq.thinking is None or not seq.thinking.thinking:
            return tokens
        return seq.thinking.limit(tokens, self.reasoner.decode)

    def feed(self, seq: SequenceState, toks: list[int]) -> tuple[int, int]:
        """A sequence's emitted tokens, before its stop checks: (index from which its grammar takes them, how many
        of those were sampled before the grammar started and must be checked by it: an implicit end)."""
        state = seq.thinking
        if state is None or not state.thinking:
            if state is not None:
                state.feed(toks)
            return 0, 0
        answer_from = state.feed(toks)
        if answer_from is not None and state.text_end is not None:
            seq.stop.mark_at(state.text_end)
        if not self._guidance.deferred(seq.request_id):  # no grammar, or one that holds the thinking too
            return 0, 0
        if answer_from is None:
            return len(toks), 0
        self._guidance.begin_answer(seq.request_id)
        if self._guidance.guided(seq.request_id) and not self._guidance.is_ready(seq.request_id):
            seq.req.hold_sampling = True  # its grammar still compiles (see defer_grammar): the answer waits for it
        return answer_from, len(toks) - answer_from
