"""MarkerThinking and the parsers on token ids alone (no model): where the thinking ends, the budget's forced end,
the text split, the starting state from a prompt."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.reasoning import (
    GenericReasoningParser,
    MarkerThinking,
    Qwen3ReasoningParser,
    ReasoningError,
    make_reasoning_parser,
)
from tandem.reasoning.parsers import ReasoningMarkers
from tandem.reasoning.state import _next_match

END = (7, 8, 9)  # a three-token end marker
TOOL = (5,)


def markers(end: tuple[int, ...] = END, implicit: tuple[tuple[int, ...], ...] = ()) -> ReasoningMarkers:
    return ReasoningMarkers("<think>", "</think>", end, implicit, "</think>", "<think>")


def plain(ids: object) -> str:
    """A decode where every id is one character (none cut)."""
    return "x" * len(list(ids))  # type: ignore[call-overload]


def test_next_match_equals_brute_force() -> None:
    rng = random.Random(0)
    for pattern in [(1, 2, 1, 3), (1, 1, 2), (1, 1, 1), (2, 1, 2, 1, 3), (4,)]:
        seq: list[int] = []
        matched = 0
        for _ in range(400):
            seq.append(rng.choice([1, 2, 3, 4]))
            matched = _next_match(pattern, matched, seq[-1]) if matched < len(pattern) else 0
            want = max((k for k in range(len(pattern) + 1) if k <= len(seq) and tuple(seq[len(seq) - k :]) == pattern[:k]),
                       default=0)
            assert matched == want, (pattern, seq[-6:])
            if matched == len(pattern):
                seq.clear()
                matched = 0


def test_the_end_marker_as_a_token_sequence_ends_the_thinking() -> None:
    s = MarkerThinking(markers(), thinking=True)
    assert s.feed([1, 7, 8]) is None  # a partial marker is still thinking
    assert s.feed([2, 7]) is None  # ... and a broken one too
    assert s.feed([8, 9, 4]) == 2  # the answer starts after the marker
    assert not s.thinking and s.text_end == 7 and s.num_reasoning_tokens == 7 and s.num_output_tokens == 8


def test_limit_cuts_a_verified_run_after_the_marker() -> None:
    s = MarkerThinking(markers(), thinking=True)
    assert s.limit([1, 7, 8, 9, 3, 4], plain) == [1, 7, 8, 9]  # rows after it were sampled without the grammar
    assert s.num_output_tokens == 0  # limit changes nothing
    assert s.limit([1, 2], plain) == [1, 2]


def test_budget_forces_the_marker_one_token_per_position() -> None:
    s = MarkerThinking(markers(), thinking=True, budget=3)
    toks = s.limit([1, 2, 3, 4, 5], plain)
    assert toks == [1, 2, 3, 7]  # the 4th token replaced, the rest of the verified run dropped
    s.feed(toks)
    assert s.forcing and s.limit([1, 2], plain) == [8]
    s.feed([8])
    assert s.limit([9, 9], plain) == [9]  # the model's own choice equals the forced token: kept, and it ends
    assert s.feed([9]) == 1 and not s.thinking and s.num_reasoning_tokens == 6


def test_budget_zero_forces_from_the_first_token_and_a_started_marker_is_completed() -> None:
    assert MarkerThinking(markers(), thinking=True, budget=0).limit([4], plain) == [7]
    s = MarkerThinking(markers(), thinking=True, budget=2)
    s.feed([1, 7])  # the model began the marker itself as the budget ran out
    assert s.limit([3], plain) == [8]


def test_budget_waits_for_a_whole_utf8_character() -> None:
    cut = {11}  # token 11 holds the first bytes of a character

    def decode(ids: object) -> str:
        ids = list(ids)  # type: ignore[call-overload]
        return "x" * len(ids) + ("\ufffd" if ids and ids[-1] in cut else "")

    s = MarkerThinking(markers(), thinking=True, budget=2)
    assert s.limit([1, 11, 12, 4], decode) == [1, 11, 12, 7]  # after 11 one more token, then the marker


def test_implicit_end_belongs_to_the_answer() -> None:
    s = MarkerThinking(markers(implicit=(TOOL,)), thinking=True)
    assert s.limit([1, 5, 6], plain) == [1, 5]
    assert s.feed([1, 5]) == 1  # "<tool_call>" is the answer's first token
    assert s.text_end == 1 and s.num_reasoning_tokens == 1


def test_a_sequence_that_answers_feeds_through() -> None:
    s = MarkerThinking(markers(), thinking=False, budget=0)
    assert s.limit([7, 1], plain) == [7, 1] and s.feed([7, 8, 9]) is None
    assert s.split("abc", finished=False) == (None, "abc") and s.num_reasoning_tokens == 0


@pytest.mark.parametrize("finished", [False, True])
def test_text_split_while_thinking_holds_back_a_partial_marker(finished: bool) -> None:
    s = MarkerThinking(markers(), thinking=True)
    assert s.split("<think>\nabc</thi", finished) == ("\nabc" if not finished else "\nabc</thi", None)
    assert s.split("<thi", finished=False) == ("", None)  # it may be writing the start marker


def test_text_split_once_ended() -> None:
    s = MarkerThinking(markers(), thinking=True)
    text = "<think>plan</think>\n\n{\"a\": 1}"
    assert s.split_marked(text, len("<think>plan</think>")) == ("plan", "\n\n{\"a\": 1}")


def test_prompt_decides_the_starting_state() -> None:
    def decode(ids: object) -> str:
        return "".join(chr(i) for i in ids)  # type: ignore[union-attr]

    def ids(text: str) -> list[int]:
        return [ord(c) for c in text]

    qwen = Qwen3ReasoningParser()
    assert qwen.starts_thinking(ids("<|im_start|>assistant\n<think>\n"), decode)
    assert not qwen.starts_thinking(ids("<|im_start|>assistant\n<think>\n\n</think>\n\n"), decode)
    assert qwen.starts_thinking(ids("<|im_start|>assistant\n"), decode)  # Qwen3 writes <think> itself
    generic = GenericReasoningParser()
    assert not generic.starts_thinking(ids("Answer:"), decode)
    assert generic.starts_thinking(ids("Answer: <think>\n"), decode)


def test_parser_registry_and_errors() -> None:
    assert make_reasoning_parser("qwen3").implicit_ends == ("<tool_call>",)
    p = make_reasoning_parser({"name": "generic", "start": "<r>", "end": "</r>"})
    assert (p.start, p.end) == ("<r>", "</r>")
    with pytest.raises(ReasoningError, match="unknown reasoning parser"):
        make_reasoning_parser("nope")
    with pytest.raises(ReasoningError):
        make_reasoning_parser({"name": "qwen3", "start": "x"})


def test_random_runs_agree_between_limit_and_feed() -> None:
    """Whatever the tokens, `limit` then `feed` leave the end marker as the last token of its step, and the budget
    is never exceeded by more than the marker."""
    rng = random.Random(1)
    for trial in itertools.count():
        if trial == 300:
            break
        budget = rng.choice([None, 0, 1, 4, 9])
        s = MarkerThinking(markers(implicit=(TOOL,)), thinking=True, budget=budget)
        emitted: list[int] = []
        while s.thinking and len(emitted) < 60:
            step = [rng.choice([1, 2, 5, 7, 8, 9]) for _ in range(rng.randint(1, 5))]
            kept = s.limit(step, plain)
            assert kept and len(kept) <= len(step) and kept[:-1] == step[: len(kept) - 1]
            at = s.feed(kept)
            emitted += kept
            if at is not None:
                assert at in (len(kept), len(kept) - 1)
        if budget is not None:
            assert s.num_reasoning_tokens <= budget + len(END)
