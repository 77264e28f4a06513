"""One sequence's thinking, token by token: where it ends, its budget, and how its text splits.

`ThinkingState` is the engine's view of it (one abstract base); `MarkerThinking` follows an end marker of fixed
token ids (Qwen3, DeepSeek-R1, generic), harmony's (gpt-oss) follows its channels (reasoning/harmony.py).

The engine calls, per step and sequence (plain Python, no tensors):

    limit(tokens, decode)   right after sampling: the step's emitted tokens as they may stand. Tokens after the
                            token that ends the thinking are dropped (their rows were sampled without the grammar
                            that starts there; to the scheduler this is a rejected draft), and once the budget is
                            spent the next token is the end marker's next token (forced: the sampled one replaced,
                            the rest dropped), so the end marker is always the last token of its step.
    feed(tokens)            the emitted tokens, in order: returns where the answer starts in them (None while the
                            thinking goes on; the grammar takes only the tokens from there).
    text_end                the output-token count through which the text is thinking (the stop checker marks the
                            text length there; the answer's text starts after it).

Invariant: a token is thinking until the end marker (`end_ids`, as a token sequence) has been emitted in full, or
an implicit end (Qwen3's `<tool_call>`) starts; `num_reasoning_tokens` counts the thinking tokens, the end marker's
included. The budget (`thinking_token_budget`) counts the thinking tokens the model chose; it is enforced only at a
whole UTF-8 character (as llama.cpp's reasoning budget waits), so a forced end never splits one.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # what a decode of a cut UTF-8 sequence ends with
UTF8_TAIL = 4  # tokens decoded to tell whether the output ends inside a character

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class ReasoningMarkers:
    """A parser's markers in one tokenizer's ids (plain data: it crosses process boundaries)."""

    start: str
    end: str
    end_ids: tuple[int, ...]
    implicit_end_ids: tuple[tuple[int, ...], ...]  # each ends the thinking; its tokens are the answer's first
    end_text: str  # `end` as the decoded output shows it ("" when the tokenizer skips it as a special token)
    start_text: str


class ThinkingState(abc.ABC):
    """One sequence's thinking as the engine sees it (see the module docstring). Invariants every state keeps:
    `thinking` only goes from True to False, at the token `feed` reports; `limit` never changes the state; the
    tokens a state sees are emitted ones (never a draft), so rollbacks need nothing from it."""

    thinking: bool  # False: it answers from here on (its grammar, if any, takes the tokens)
    budget: int | None  # thinking tokens allowed (None: no limit)
    num_reasoning_tokens: int  # thinking tokens emitted, the end of the thinking included
    text_end: int | None  # output tokens that are thinking text (None: not ended, or never thought)

    @property
    def forcing(self) -> bool:
        """The budget ran out: the way out of the thinking is due (its next token forced, at a whole character)."""
        return self.thinking and self.budget is not None and self.num_reasoning_tokens >= self.budget

    def limit(self, tokens: list[int], decode: Decode) -> list[int]:
        """The tokens of this step that may be emitted: a prefix of `tokens` ending at the end of the thinking, its
        last one possibly replaced by a token the spent budget forces. The state is unchanged: `feed` the result."""
        if not self.thinking or not tokens:
            return tokens
        probe = self._probe()
        for i, token in enumerate(tokens):
            forced = probe._forced_next(decode)
            if forced is not None and forced != token:
                return [*tokens[:i], forced]
            if probe._ends_at(int(token)):  # it ends here: the rest was sampled without its grammar
                return tokens[: i + 1]
        return tokens

    @abc.abstractmethod
    def _probe(self) -> ThinkingState:
        """A copy `limit` may advance (this state unchanged)."""

    @abc.abstractmethod
    def _forced_next(self, decode: Decode) -> int | None:
        """The token the spent budget forces next (None: none, or not yet: the output ends inside a character)."""

    @abc.abstractmethod
    def _ends_at(self, token: int) -> bool:
        """Advance over one thinking token; True when it ended the thinking."""

    @abc.abstractmethod
    def feed(self, tokens: Sequence[int]) -> int | None:
        """Advance over emitted tokens (every one, thinking or not); the index in `tokens` where the answer starts
        if the thinking ended in them, else None."""

    @abc.abstractmethod
    def split(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(thinking, answer) of the output `text` while the thinking has not ended: the answer None until it
        begins."""

    @abc.abstractmethod
    def split_marked(self, text: str, marked_len: int) -> tuple[str | None, str | None]:
        """(thinking, answer) once the thinking ended: `marked_len` is the text's length at `text_end`."""


@dataclass
class MarkerThinking(ThinkingState):
    """The thinking of one sequence closed by an end marker of fixed ids (see the module docstring)."""

    markers: ReasoningMarkers
    thinking: bool
    budget: int | None = None
    num_reasoning_tokens: int = 0  # thinking tokens emitted, end marker included
    num_output_tokens: int = 0
    text_end: int | None = None  # output tokens that are thinking text (None: not ended, or never thought)
    opened_thinking: bool = False  # it thought at all (set from `thinking` at the start)
    _matched: int = 0  # tokens of end_ids matched at the end of the output so far
    _implicit: list[int] = field(default_factory=list)  # the same for each implicit end
    _tail: list[int] = field(default_factory=list)  # the last output tokens (the UTF-8 check)

    def __post_init__(self) -> None:
        self.opened_thinking = self.thinking
        self._implicit = [0] * len(self.markers.implicit_end_ids)

    # ------------------------------------------------------------------------------------------- the step
    def feed(self, tokens: Sequence[int]) -> int | None:
        """Advance over emitted tokens; the index in `tokens` where the answer starts if the thinking ended in
        them (len(tokens) when the last one ended it), else None."""
        if not self.thinking:
            self.num_output_tokens += len(tokens)
            return None
        for i, token in enumerate(tokens):
            self.num_output_tokens += 1
            ended = self._advance(int(token))
            if ended is not None:  # an implicit end's `ended` tokens are the answer's
                self.num_reasoning_tokens -= ended
                self.text_end = self.num_output_tokens - ended
                self.thinking = False
                self.num_output_tokens += len(tokens) - i - 1
                return i + 1 - ended
        return None

    def _advance(self, token: int) -> int | None:
        """One thinking token; None, or how many of the tokens just seen belong to the answer (0: the end marker
        completed; m > 0: an implicit end of m tokens completed)."""
        self._tail = [*self._tail[1 - UTF8_TAIL :], token]
        self.num_reasoning_tokens += 1
        ids = self.markers.end_ids
        self._matched = _next_match(ids, self._matched, token)
        if self._matched == len(ids):
            return 0
        for j, implicit in enumerate(self.markers.implicit_end_ids):
            self._implicit[j] = _next_match(implicit, self._implicit[j], token)
            if self._implicit[j] == len(implicit):
                return len(implicit)
        return None

    def _ends_at(self, token: int) -> bool:
        return self._advance(token) is not None

    def _forced_next(self, decode: Decode) -> int | None:
        """The end marker's next token once the budget is spent, unless the output ends inside a UTF-8 character
        (then the model writes one more token first)."""
        if not self.forcing:
            return None
        if self._matched == 0 and self._tail and decode(self._tail).endswith(REPLACEMENT):
            return None
        return self.markers.end_ids[self._matched]

    def _probe(self) -> MarkerThinking:
        twin = MarkerThinking(self.markers, self.thinking, self.budget, self.num_reasoning_tokens)
        twin._matched, twin._implicit, twin._tail = self._matched, list(self._implicit), list(self._tail)
        return twin

    # ------------------------------------------------------------------------------------------ the text
    def split(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(thinking, answer) of the output text while the thinking has not ended (`split_marked` after). While
        it thinks, the end of the text that could still become the end marker is held back (unless finished),
        and the answer is None; a sequence that never thought is all answer."""
        if not self.opened_thinking:
            return None, text
        start = self.markers.start_text
        if not finished and start and start.startswith(text):
            return "", None  # it may be writing the start marker itself
        reasoning = _strip_start(text, start)
        if not finished:
            reasoning = reasoning[: len(reasoning) - _partial_suffix(reasoning, self.markers.end_text)]
        return reasoning, None

    def split_marked(self, text: str, marked_len: int) -> tuple[str | None, str | None]:
        """(thinking, answer) once the thinking ended: `marked_len` is the text's length at `text_end`."""
        head, answer = text[:marked_len], text[marked_len:]
        head = _strip_start(head, self.markers.start_text)
        end = self.markers.end_text
        if end and head.endswith(end):
            head = head[: len(head) - len(end)]
        return head, answer


def _next_match(pattern: Sequence[int], matched: int, token: int) -> int:
    """Tokens of `pattern` matched at the end of a sequence after `token` is appended (KMP-free: markers are a few
    tokens long, so the fallback tries each shorter prefix)."""
    if matched < len(pattern) and pattern[matched] == token:
        return matched + 1
    for k in range(min(matched, len(pattern) - 1), 0, -1):
        # the last k tokens (ending with `token`) equal pattern[:k]: pattern[matched-k+1:matched] + [token]
        if pattern[k - 1] == token and list(pattern[matched - k + 1 : matched]) == list(pattern[: k - 1]):
            return k
    return 0


def _strip_start(text: str, start: str) -> str:
    """`text` without a leading start marker (a model that opens the block itself writes it first)."""
    return text[len(start) :] if start and text.startswith(start) else text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


