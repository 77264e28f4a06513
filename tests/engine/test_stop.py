"""StopChecker: EOS, stop token ids, stop strings split across tokens, hold-back, min/max tokens, max_model_len."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.engine.stop import StopChecker, StopDecision
from tandem.params import RequestOutputKind, SamplingParams
from tandem.tokenizer import Tokenizer

DATA = Path(__file__).parents[2] / "../shared/data"
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_path(DATA / "tokenizers/gpt2")


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer.from_path(DATA / "models/stories260K")


def checker(
    tok: Tokenizer, prompt: Sequence[int] = (), max_model_len: int = MAX_MODEL_LEN, **params: object
) -> StopChecker:
    params.setdefault("max_tokens", 1000)
    return StopChecker(tok, list(prompt), SamplingParams(**params), max_model_len)  # type: ignore[arg-type]


def feed(sc: StopChecker, ids: Sequence[int]) -> tuple[int, StopDecision]:
    """Add `ids` one at a time until the request finishes; return how many were added and the last decision."""
    decision = StopDecision(False, None, None, 0)
    for n, token_id in enumerate(ids, start=1):
        decision = sc.add_tokens([token_id])
        assert decision.num_tokens_kept == 1
        if decision.finished:
            return n, decision
    return len(ids), decision


def test_stop_string_split_across_tokens_is_cut(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world. The END is here")  # Hello| world|.| The| END| is| here
    sc = checker(gpt2, stop="lo wor")
    n, d = feed(sc, ids)
    assert (n, d.finished, d.reason, d.stop_reason) == (2, True, "stop", "lo wor")
    assert sc.text == sc.visible_text() == "Hel"
    assert sc.finished and sc.finish_reason == "stop" and sc.stop_reason == "lo wor"


def test_stop_string_included_in_output(gpt2: Tokenizer) -> None:
    sc = checker(gpt2, stop=["lo wor"], include_stop_str_in_output=True)
    n, d = feed(sc, gpt2.encode("Hello world. The END is here"))
    assert n == 2 and d.stop_reason == "lo wor"
    assert sc.text == "Hello wor"  # the rest of the stopping token (" world" -> "ld") is dropped


def test_stop_string_in_a_multi_token_step(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world. The END is here")
    sc = checker(gpt2, stop=["END"])
    d = sc.add_tokens(ids)
    assert d == StopDecision(True, "stop", "END", 5)
    assert sc.text == "Hello world. The "
    assert sc.num_output_tokens == 5
    with pytest.raises(RuntimeError):
        sc.add_tokens(ids[5:])


def test_first_completed_stop_string_wins(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world. The END is here")
    sc = checker(gpt2, stop=["is here", "The END", "END"])
    d = sc.add_tokens(ids)
    # "The END" and "END" both end with token 5; the earlier-starting match cuts more
    assert d.stop_reason == "The END" and d.num_tokens_kept == 5 and sc.text == "Hello world. "


def test_stop_string_split_inside_a_character(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello 😀 世界 end")
    sc = checker(gpt2, stop="世")
    n, d = feed(sc, ids)
    assert gpt2.decode(ids[:n]).endswith("世") and d.stop_reason == "世"
    assert sc.text == "Hello 😀 "


def test_stop_string_with_sentencepiece_spaces(stories: Tokenizer) -> None:
    ids = stories.encode("Once upon a time, there was", add_special_tokens=False)
    sc = checker(stories, prompt=[1], stop=" upon")
    n, d = feed(sc, ids)
    assert n == 2 and d.stop_reason == " upon" and sc.text == "Once"


def test_visible_text_holds_back_a_possible_stop_prefix(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("abc <END> x")  # abc| <|END|>| x
    sc = checker(gpt2, stop=["<END>"])
    sc.add_tokens(ids[:2])
    assert sc.text == "abc <" and sc.visible_text() == "abc "
    sc.add_tokens(ids[2:3])
    assert sc.text == "abc <END" and sc.visible_text() == "abc "
    d = sc.add_tokens(ids[3:])
    assert d.finished and d.num_tokens_kept == 1 and sc.visible_text() == sc.text == "abc "

    # a prefix that stops matching is released
    sc = checker(gpt2, stop=["<END>"])
    sc.add_tokens(gpt2.encode("abc <"))
    assert sc.visible_text() == "abc "
    sc.add_tokens(gpt2.encode(" x"))
    assert sc.visible_text() == sc.text == "abc < x"

    # nothing is held back when the stop string would be kept anyway
    sc = checker(gpt2, stop=["<END>"], include_stop_str_in_output=True)
    sc.add_tokens(ids[:2])
    assert sc.visible_text() == "abc <"


def test_visible_text_only_grows(gpt2: Tokenizer) -> None:
    text = "a <b <E <EN <END <EN <END> tail"
    sc = checker(gpt2, stop=["<END>", "<b>", "xyz"])
    seen = ""
    for token_id in gpt2.encode(text):
        if sc.add_tokens([token_id]).finished:
            break
        visible = sc.visible_text()
        assert visible.startswith(seen) and sc.text.startswith(visible)
        seen = visible
    assert sc.finished and sc.text == "a <b <E <EN <END <EN " and sc.text.startswith(seen)


def test_stop_token_ids(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world. The END is here")
    sc = checker(gpt2, stop_token_ids=[ids[3]])  # " The"
    d = sc.add_tokens(ids)
    assert d == StopDecision(True, "stop", ids[3], 4)
    assert sc.text == "Hello world."  # the stop token adds no text


def test_eos_and_ignore_eos(gpt2: Tokenizer) -> None:
    eos = gpt2.eos_token_ids[0]
    words = gpt2.encode("Hello world")
    sc = checker(gpt2)
    d = sc.add_tokens([*words, eos, *words])
    assert d == StopDecision(True, "stop", None, 3)  # EOS in the middle: keep the tokens up to and with it
    assert sc.text == "Hello world" and sc.num_output_tokens == 3

    sc = StopChecker(gpt2, [], SamplingParams(max_tokens=100), MAX_MODEL_LEN, extra_eos_token_ids=[words[1]])
    assert sc.add_tokens([*words, eos]) == StopDecision(
        True, "stop", None, 2
    )  # " world" ends it as an extra EOS

    sc = checker(gpt2, ignore_eos=True)
    d = sc.add_tokens([*words, eos, *words])
    assert not d.finished and d.num_tokens_kept == 5 and sc.text == "Hello worldHello world"


def test_min_tokens_delays_every_stop(gpt2: Tokenizer) -> None:
    eos = gpt2.eos_token_ids[0]
    hello, world = gpt2.encode("Hello world")
    sc = checker(gpt2, min_tokens=2)
    assert not sc.add_tokens([hello, eos]).finished  # EOS as 2nd token: only 1 token before it, < min_tokens
    assert sc.add_tokens([eos]) == StopDecision(True, "stop", None, 1)

    sc = checker(gpt2, min_tokens=2, stop_token_ids=[world])
    assert sc.add_tokens([world, world, world]) == StopDecision(True, "stop", world, 3)

    sc = checker(gpt2, min_tokens=2, stop=["Hello"])
    d = sc.add_tokens([hello, world, hello, world])
    assert d == StopDecision(True, "stop", "Hello", 3) and sc.text == "Hello world"


def test_max_tokens(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world. The END is here")
    sc = checker(gpt2, max_tokens=3)
    d = sc.add_tokens(ids)
    assert d == StopDecision(True, "length", None, 3) and sc.text == "Hello world."

    sc = checker(gpt2, max_tokens=3)
    n, d = feed(sc, ids)
    assert n == 3 and d.reason == "length"

    # a stop string completed by the last allowed token is a stop, not a length finish
    sc = checker(gpt2, max_tokens=3, stop=["."])
    assert sc.add_tokens(ids) == StopDecision(True, "stop", ".", 3)


def test_max_model_len(gpt2: Tokenizer) -> None:
    prompt = gpt2.encode("one two three four five")
    assert len(prompt) == 5
    ids = gpt2.encode(" six seven eight nine")
    sc = checker(gpt2, prompt=prompt, max_model_len=8, max_tokens=None)
    assert sc.add_tokens(ids) == StopDecision(True, "length", None, 3)
    assert sc.text == " six seven eight"


@pytest.mark.parametrize("stop", [(), ("END",)])
def test_a_final_only_request_gets_its_text_when_read(gpt2: Tokenizer, stop: tuple[str, ...]) -> None:
    # FINAL_ONLY without stop strings: nothing is detokenized per token (the decisions do not need text); the
    # text read at the end is the streaming one. With a stop string, the text is still made per token.
    ids = gpt2.encode("Hello 😀 world. The END is here")
    streaming, final = checker(gpt2, stop=stop), checker(gpt2, stop=stop, output_kind=RequestOutputKind.FINAL_ONLY)
    assert feed(streaming, ids) == feed(final, ids)
    deferred = final._undecoded if not stop else []
    assert len(deferred) == (len(ids) if not stop else 0)
    assert final.text == streaming.text == final.visible_text()
    assert not final._undecoded


def test_a_deferred_text_that_fails_to_decode_is_reported_once(gpt2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = checker(gpt2, output_kind=RequestOutputKind.FINAL_ONLY)

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("decode failed")

    monkeypatch.setattr(gpt2, "decode", broken)
    sc.add_tokens(gpt2.encode(" hello"))  # no decision needs the text: no error yet
    with pytest.raises(RuntimeError, match="decode failed"):
        sc.decode_deferred()
    assert sc.text == ""  # reading it afterwards never raises


@pytest.mark.parametrize("seed", range(4))
def test_ends_with_foresees_what_add_tokens_decides(gpt2: Tokenizer, seed: int) -> None:
    """`ends_with` (read before a launch, changing nothing) says True exactly when `add_tokens` of the same ids then
    ends the request by a token id or its length (EOS, stop ids, min_tokens, ignore_eos, max_tokens, the model's
    length), step after step of 1-5 ids; with stop strings it may miss such an end, never invent one."""
    rng = random.Random(seed)
    eos = gpt2.eos_token_ids[0]
    pool = [eos, 11, 13, 198, 262, 290, 318, 340, 383, 612]  # EOS, ",", ".", "\n", " the", " and", ...
    for case in range(60):
        most = rng.choice([None, 3, 8, 20])
        params: dict[str, object] = {"max_tokens": most, "min_tokens": min(most or 99, rng.choice([0, 0, 2, 6])),
                                     "ignore_eos": rng.random() < 0.3, "stop_token_ids": rng.sample(pool[1:], rng.randint(0, 2))}
        if case % 3 == 0:
            params["stop"] = [" the and"]
        sc = checker(gpt2, prompt=[262] * rng.choice([1, 4000]), max_model_len=4020, **params)
        while not sc.finished:
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 5))]
            foreseen = sc.ends_with(ids)
            decision = sc.add_tokens(ids)
            if "stop" in params:
                assert decision.finished or not foreseen, (params, ids)
            else:
                assert foreseen == decision.finished, (params, ids)
        assert sc.ends_with([290])  # an ended request stays ended
