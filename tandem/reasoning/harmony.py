"""gpt-oss's reasoning (`reasoning_parser="openai_gptoss"`, vLLM's name): its output is harmony messages, and the
thinking is everything before the body of its `final` message.

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>
    |------------------------- thinking: reasoning = the analysis text ----------------||- answer -|

`HarmonyThinking` follows one sequence with two readers of the same tokens:

    HarmonyPhase   plain Python, cheap to copy (`limit` probes a copy): header / body / between messages / done, and
                   the header's channel. The thinking ends at the `<|message|>` that opens a `final` body, whatever
                   the header holds besides (`<|constrain|>json`, the role): where vLLM ends it too. So a grammar
                   (guided JSON) takes only the final answer; a tool call is no final answer (the thinking goes on
                   through it, and its tokens count as thinking).
    HarmonyReader  openai_harmony's StreamableParser (tools/harmony.py): the text of each channel. reasoning =
                   analysis, answer = final (and commentary preambles); the answer is not null once any message
                   other than analysis began (a tool call's turn has answer "", its call is read by the `openai`
                   tool parser from the token ids).

The text split follows the tokens, not the stop checker's text: harmony's headers are ordinary tokens ("analysis",
"assistant"), so the decoded text cannot be cut at one mark. A spent budget forces the shortest harmony continuation
into a final body, one token at a time: from a body `<|end|><|start|>assistant<|channel|>final<|message|>`, from an
open header first `<|message|>` (an empty message), right after `<|channel|>` just `final<|message|>`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.reasoning.parsers import Decode, Encode, ReasoningError, ReasoningMarkers, ReasoningParser
from tandem.reasoning.state import REPLACEMENT, UTF8_TAIL, ThinkingState
from tandem.tools.harmony import (
    ASSISTANT_ID,
    CHANNEL,
    END,
    FINAL_ID,
    MESSAGE,
    START,
    STOPS,
    HarmonyReader,
    harmony_encoding,
    header_channel,
)

END_OF_THINKING = (CHANNEL, FINAL_ID, MESSAGE)  # "<|channel|>final<|message|>" in o200k_harmony


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (harmony): analysis is the thinking, the final message the answer (see the module docstring)."""

    name = "openai_gptoss"
    start = ""
    end = "<|channel|>final<|message|>"
    thinks_by_default = True

    def __init__(self) -> None:
        self._encoding: Any = None

    def markers(self, encode: Encode, decode: Decode) -> ReasoningMarkers:
        """The canonical end marker's ids; ReasoningError unless the tokenizer is o200k_harmony. Loads harmony's
        encoding (ConfigError when its vocabulary is nowhere: tools/harmony.py)."""
        markers = super().markers(encode, decode)
        if markers.end_ids != END_OF_THINKING:
            raise ReasoningError(f"reasoning parser {self.name!r} needs gpt-oss's o200k_harmony vocabulary: this "
                                 f"tokenizer writes {self.end!r} as {list(markers.end_ids)}, not {list(END_OF_THINKING)}")
        self._encoding = harmony_encoding()
        return markers

    def start_state(self, markers: ReasoningMarkers, prompt_ids: Sequence[int], budget: int | None,
                    decode: Decode) -> ThinkingState:
        """The sequence's state, primed with the prompt from its last `<|start|>` on."""
        if self._encoding is None:
            self._encoding = harmony_encoding()
        return HarmonyThinking.after(self._encoding, prompt_ids, budget)


@dataclass
class HarmonyPhase:
    """Where the output is in harmony's message grammar (what the thinking's end and the forced tokens need)."""

    decode: Callable[[Sequence[int]], str]  # harmony's decode: special tokens spelled out
    mode: str = "header"  # "header" | "body" | "between" (after <|end|>) | "done" (after <|return|> / <|call|>)
    header: list[int] = field(default_factory=list)
    explicit_start: bool = False  # the header began at a written <|start|> (its role comes first)
    channel: str | None = None  # the open body's channel

    def advance(self, token: int) -> bool:
        """Take one token; True when it opens the body of a final message."""
        if self.mode == "done" or token in STOPS:  # as the reader: nothing after a stop token is read
            self.mode = "done"
            return False
        if self.mode == "between":  # anything but <|start|> begins a message as after "<|start|>assistant"
            self.mode, self.header, self.explicit_start = "header", [], token == START
            return False if token == START else self.advance(token)
        if self.mode == "body":
            self.mode = "between" if token == END else "body"
            return False
        if token == MESSAGE:
            self.mode, self.channel = "body", header_channel(self.decode(self.header))
            return self.channel == "final"
        if token == START:
            self.header, self.explicit_start = [], True
        else:
            self.header.append(token)
        return False

    def next_forced(self) -> int | None:
        """The next token of the shortest way from here into a final body (None once the output is done)."""
        if self.mode == "done":
            return None
        if self.mode == "body":
            return END
        if self.mode == "between":
            return START
        h = self.header
        if h and h[-1] == CHANNEL:
            return FINAL_ID
        if not h:
            return ASSISTANT_ID if self.explicit_start else CHANNEL
        if h == [ASSISTANT_ID] and self.explicit_start:
            return CHANNEL
        return MESSAGE  # a header of its own: closed as an empty message, then the way from a body


@dataclass
class HarmonyThinking(ThinkingState):
    """One gpt-oss sequence (see the module docstring). `thinking` False: its final body has begun."""

    phase: HarmonyPhase
    reader: HarmonyReader
    thinking: bool
    budget: int | None = None
    num_reasoning_tokens: int = 0
    num_output_tokens: int = 0
    text_end: int | None = None
    _tail: list[int] = field(default_factory=list)  # the last output tokens (the budget's UTF-8 check)

    @classmethod
    def after(cls, encoding: Any, prompt_ids: Sequence[int], budget: int | None) -> HarmonyThinking:
        """The state after `prompt_ids`: its tail from the last `<|start|>` primes both readers."""
        tail = prompt_tail(prompt_ids)
        phase = HarmonyPhase(encoding.decode, mode="between" if tail else "header")
        for t in tail:
            phase.advance(int(t))
        thinking = phase.mode != "done" and not (phase.mode == "body" and phase.channel == "final")
        return cls(phase, HarmonyReader(encoding, tail), thinking, budget)

    def feed(self, tokens: Sequence[int]) -> int | None:
        answer_from = None
        for i, token in enumerate(tokens):
            self.reader.feed(int(token))
            self.num_output_tokens += 1
            if self.thinking and self._ends_at(int(token)):
                self.thinking, self.text_end, answer_from = False, self.num_output_tokens, i + 1
        return answer_from

    def split(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(analysis text, answer text or None before any answer began), as harmony reads the tokens."""
        r = self.reader
        return r.reasoning or None, r.content if r.answering else None

    def split_marked(self, text: str, marked_len: int) -> tuple[str | None, str | None]:
        return self.split(text, True)

    def _ends_at(self, token: int) -> bool:
        """One thinking token; True when it ended the thinking (the way into a final body is complete)."""
        self._tail = [*self._tail[1 - UTF8_TAIL :], token]
        self.num_reasoning_tokens += 1
        return self.phase.advance(token)

    def _forced_next(self, decode: Decode) -> int | None:
        """The forced token once the budget is spent, unless a body ends inside a UTF-8 character."""
        if not self.forcing:
            return None
        if self.phase.mode == "body" and self._tail and decode(self._tail).endswith(REPLACEMENT):
            return None
        return self.phase.next_forced()

    def _probe(self) -> HarmonyThinking:
        """A copy for `limit` (the reader is shared: a probe never feeds it)."""
        phase = replace(self.phase, header=list(self.phase.header))
        return replace(self, phase=phase, _tail=list(self._tail))


def prompt_tail(prompt_ids: Sequence[int]) -> list[int]:
    """The prompt from its last `<|start|>` on ([] when it has none: the model writes its header right away)."""
    for i in range(len(prompt_ids) - 1, -1, -1):
        if prompt_ids[i] == START:
            return [int(t) for t in prompt_ids[i:]]
    return []
