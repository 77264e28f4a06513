"""When does a request end, and what text does it keep: EOS, stop token ids, stop strings and the length limits.

Rules, checked for each new output token in order (the n-th output token, n counting from 1):
1. n > min_tokens: a token in `stop_token_ids` ends the request ("stop", stop_reason = the id); an EOS id of the
   tokenizer ends it ("stop", stop_reason None) unless `ignore_eos`. The stopping token stays in the output token ids
   but adds no text. Before that (n <= min_tokens) these tokens are ordinary tokens.
2. The token's text is appended; n > min_tokens: a stop string that ends inside the new text ends the request
   ("stop", stop_reason = the string). The text is cut before the stop string, or right after it with
   `include_stop_str_in_output`. Among several matches the one that completes first (smallest end) wins.
3. n == max_tokens, or num_prompt + n >= max_model_len: "length".
Tokens after the stopping one in the same call are dropped (`StopDecision.num_tokens_kept`), as when speculative
decoding accepts several tokens in one step.

A request that reports only its final output (`RequestOutputKind.FINAL_ONLY`) and has no stop strings needs no
text while it runs: its tokens are detokenized when `text` is read, in one decode (`add_tokens_at_once`).
Streaming: `visible_text()` leaves out the longest end of the text that is the start of some stop string, since the
next token may complete the stop string and that text would then be cut. This held-back part only ever shrinks into
visible text or is cut, so the visible text only grows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.params import RequestOutputKind, SamplingParams
from tandem.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class StopDecision:
    finished: bool
    reason: str | None  # "stop" | "length" | None
    stop_reason: int | str | None  # the stop string or stop token id; None for EOS, length, or not finished
    num_tokens_kept: int  # how many of the new tokens to keep (later ones are dropped)


class StopChecker:
    """Decides, token by token, when a request ends; holds back text that might be the start of a stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        max_model_len: int,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        """`extra_eos_token_ids` (e.g. the model config's eos ids) end the request like the tokenizer's EOS."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self._params = params
        eos_ids = (*tokenizer.eos_token_ids, *extra_eos_token_ids)
        self._eos_ids = frozenset(() if params.ignore_eos else eos_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._end_ids = self._stop_ids | self._eos_ids
        self._stops = params.stop
        # the output may grow to max_tokens tokens, and prompt + output to max_model_len tokens
        self._max_output = max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None:
            self._max_output = min(self._max_output, params.max_tokens)
        self.num_output_tokens = 0
        self._text = ""
        # ids not yet detokenized: text is read only at the end and no stop string needs it before
        self._defer_text = not self._stops and params.output_kind is RequestOutputKind.FINAL_ONLY
        self._undecoded: list[int] = []
        self._mark_at: int | None = None  # see mark_at
        self._undecoded_mark: int | None = None
        self.marked_len: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text so far (stop strings cut; deferred ids detokenized now). Best effort: ids that fail to
        detokenize here are logged and left out; `decode_deferred` first, to end the request on such a failure."""
        try:
            self.decode_deferred()
        except Exception:  # noqa: BLE001 - reading an output must not raise; the request reports its own error
            logger.exception("detokenizing the output failed")
        return self._text

    def decode_deferred(self) -> None:
        """Detokenize the ids deferred so far (raises what the tokenizer raises; they are dropped then)."""
        if self._undecoded:
            ids, self._undecoded = self._undecoded, []
            cut, self._undecoded_mark = self._undecoded_mark, None
            if cut is not None:
                self._text += self._detokenizer.add_tokens_at_once(ids[:cut])
                self.marked_len, ids = len(self._text), ids[cut:]
            self._text += self._detokenizer.add_tokens_at_once(ids)

    def mark_at(self, num_output_tokens: int) -> None:
        """Record the text's length once `num_output_tokens` output tokens are in it (`marked_len`): where a
        reasoning model's thinking ends. Call before those tokens are added."""
        self._mark_at = num_output_tokens
        if num_output_tokens <= self.num_output_tokens:  # already in (the end of a step that was cut): mark now
            self._mark_at = None
            self.decode_deferred()
            self.marked_len = len(self._text)

    def add_tokens(self, token_ids: Sequence[int]) -> StopDecision:
        """Process `token_ids` in order up to the first that ends the request; advance text and the detokenizer."""
        if self.finished:
            raise RuntimeError(f"add_tokens after the request finished ({self.finish_reason})")
        for kept, token_id in enumerate(token_ids, start=1):
            self.num_output_tokens += 1
            self._check_token(token_id)
            if self.finished:
                return StopDecision(True, self.finish_reason, self.stop_reason, kept)
        return StopDecision(False, None, None, len(token_ids))

    def ends_with(self, token_ids: Sequence[int]) -> bool:
        """Whether `add_tokens(token_ids)` would end the request by a token id or by its length (rules 1 and 3),
        changing nothing. A stop string (rule 2) shows only once detokenized: such an end is not foreseen here."""
        n = self.num_output_tokens
        if self.finish_reason is not None or n + len(token_ids) >= self._max_output:
            return True
        if self._end_ids.isdisjoint(token_ids):
            return False
        min_tokens = self._params.min_tokens
        return any(n + i > min_tokens and t in self._end_ids for i, t in enumerate(token_ids, start=1))

    def _check_token(self, token_id: int) -> None:
        """Apply rules 1-3 of the module docstring to one output token; sets finish_reason when it ends."""
        may_stop = self.num_output_tokens > self._params.min_tokens
        if may_stop and token_id in self._stop_ids:
            self._finish(FINISH_STOP, token_id)
            return
        if may_stop and token_id in self._eos_ids:
            self._finish(FINISH_STOP, None)
            return
        if self._defer_text:
            self._undecoded.append(token_id)
        else:
            delta = self._detokenizer.add_tokens([token_id])
            if delta:
                old_len = len(self._text)
                self._text += delta
                if may_stop and self._stops and self._cut_at_stop_string(old_len):
                    return
        if self.num_output_tokens == self._mark_at:
            self._mark_at = None
            if self._defer_text:
                self._undecoded_mark = len(self._undecoded)
            else:
                self.marked_len = len(self._text)
        if self.num_output_tokens >= self._max_output:
            self._finish(FINISH_LENGTH, None)

    def _cut_at_stop_string(self, old_len: int) -> bool:
        """Find the stop string that ends first inside text[old_len:]; cut the text there and finish. True if found."""
        # a match must end after old_len, so it starts at or after old_len - (len(stop) - 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                match = (start + len(stop), start, stop)
                if best is None or match[:2] < best[:2]:
                    best = match
        if best is None:
            return False
        end, start, stop = best
        self._text = self._text[:end] if self._params.include_stop_str_in_output else self._text[:start]
        self._finish(FINISH_STOP, stop)
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def visible_text(self) -> str:
        """`text` minus its end that could still grow into a stop string (for streaming); == text once finished."""
        if self.finished or not self._stops or self._params.include_stop_str_in_output:
            return self.text
        return self.text[: len(self.text) - self._held_back_len()]

    def _held_back_len(self) -> int:
        """Length of the longest end of `text` that is a proper prefix of some stop string."""
        text = self.text
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
