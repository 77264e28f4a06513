"""Incremental detokenizer on real tokenizers: GPT-2 byte-level BPE and stories260K SentencePiece byte fallback."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.params import SamplingParams
from tandem.tokenizer import Tokenizer

DATA = Path(__file__).parents[2] / "../shared/data"
TEXTS = [
    "Hello 😀 世界 end",
    "日本語のテキストと中文文本",
    "🎉🎉🎉 party 👨‍👩‍👧 family",
    "Ünïcödé ñ — “quotes” … ok",
    "Once upon a time, there was a little girl named Lily.",
]


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_path(DATA / "tokenizers/gpt2")


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer.from_path(DATA / "models/stories260K")


@pytest.fixture(scope="module", params=["gpt2", "stories"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(
    tok: Tokenizer, prompt: Sequence[int], output: Sequence[int], chunk: int = 1, **params: object
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `output` `chunk` tokens at a time; return the deltas and the detokenizer."""
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    deltas = [det.add_tokens(output[i : i + chunk]) for i in range(0, len(output), chunk)]
    return deltas, det


def continuation(tok: Tokenizer, prompt: Sequence[int], output: Sequence[int], skip: bool = True) -> str:
    """The text `output` adds after `prompt`, by decoding both in full (the reference)."""
    full = tok.decode([*prompt, *output], skip_special_tokens=skip)
    return full[len(tok.decode(prompt, skip_special_tokens=skip)) :]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_gives_the_text_and_no_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    deltas, det = stream(tok, bos, ids)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == det.text == text == tok.decode(ids)
    assert det.num_tokens == len(ids)


def test_the_texts_really_split_characters_across_tokens(gpt2: Tokenizer, stories: Tokenizer) -> None:
    # guards the test above: some single tokens decode to an incomplete UTF-8 sequence
    for tok in (gpt2, stories):
        ids = tok.encode(TEXTS[0], add_special_tokens=False)
        assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    assert "<0xE4>" in stories.hf.convert_ids_to_tokens(stories.encode("世界", add_special_tokens=False))


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_per_call_give_the_same_text(tok: Tokenizer, chunk: int) -> None:
    text = " ".join(TEXTS)
    prompt = tok.encode("Prompt: 你好")
    ids = tok.encode(text, add_special_tokens=False)
    deltas, det = stream(tok, prompt, ids, chunk=chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert det.text == continuation(tok, prompt, ids)


def test_prompt_context_gives_the_leading_space(stories: Tokenizer) -> None:
    prompt = stories.encode("Once upon a")
    ids = stories.encode("Once upon a time there", add_special_tokens=False)[len(prompt) - 1 :]
    assert stories.hf.convert_ids_to_tokens(ids[:1]) == ["▁time"]
    deltas, det = stream(stories, prompt, ids)
    assert deltas[0] == " time"  # "▁time" alone decodes to "time"; after the prompt it is " time"
    assert det.text == " time there"
    # right after BOS, the first "▁" is dropped, as a full decode of the output does
    deltas, det = stream(stories, [1], stories.encode("Once upon", add_special_tokens=False))
    assert deltas == ["Once", " upon"]


def test_prompt_ending_inside_a_long_token_window(gpt2: Tokenizer) -> None:
    prompt = gpt2.encode("x" * 3 + " 😀" * 10)  # more prompt tokens than the context window
    ids = gpt2.encode(" 世界 done")
    deltas, det = stream(gpt2, prompt, ids)
    assert det.text == " 世界 done" and all("\ufffd" not in d for d in deltas)


def test_skip_special_tokens(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    eos_text = str(tok.hf.convert_ids_to_tokens(eos))
    words = tok.encode("Once upon", add_special_tokens=False)
    out = [*words, eos, *words]
    _, det = stream(tok, [], out)
    assert det.text == tok.decode(out) and eos_text not in det.text
    _, det = stream(tok, [], out, skip_special_tokens=False)
    assert det.text == tok.decode(out, skip_special_tokens=False)
    assert eos_text in det.text


def test_random_byte_level_tokens_match_a_full_decode(gpt2: Tokenizer) -> None:
    # random GPT-2 ids make arbitrary byte strings (invalid UTF-8 included); a byte-level decode is local, so the
    # emitted text is exactly the full decode, except a trailing incomplete character that is never emitted
    rng = random.Random(0)
    prompt = gpt2.encode("Random:")
    for _ in range(20):
        ids = [rng.randrange(gpt2.vocab_size - 1) for _ in range(rng.randrange(1, 60))]
        _, det = stream(gpt2, prompt, ids)
        reference = continuation(gpt2, prompt, ids)
        if reference.endswith("\ufffd"):
            assert reference.startswith(det.text)
        else:
            assert det.text == reference


def test_work_per_call_does_not_grow_with_the_output(gpt2: Tokenizer) -> None:
    windows: list[int] = []

    class Spy(Tokenizer):
        def decode(
            self,
            ids: Sequence[int],
            skip_special_tokens: bool = True,
            spaces_between_special_tokens: bool = True,
        ) -> str:
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens, spaces_between_special_tokens)

    spy = Spy(gpt2.hf)
    ids = gpt2.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 500
    _, det = stream(spy, gpt2.encode("Go:"), ids)
    assert det.text == continuation(gpt2, gpt2.encode("Go:"), ids)
    assert max(windows) <= 10  # a few tokens of context + an incomplete character, never the whole output


def test_skipped_special_tokens_do_not_widen_the_window(gpt2: Tokenizer) -> None:
    eos = gpt2.eos_token_ids[0]
    assert gpt2.special_token_ids == {eos} and gpt2.decode([eos]) == ""
    windows: list[int] = []

    class Spy(Tokenizer):
        def decode(
            self,
            ids: Sequence[int],
            skip_special_tokens: bool = True,
            spaces_between_special_tokens: bool = True,
        ) -> str:
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens, spaces_between_special_tokens)

    out = [*gpt2.encode("Hi 😀"), *([eos] * 300), *gpt2.encode(" there")]
    _, det = stream(Spy(gpt2.hf), [], out)
    assert det.text == "Hi 😀 there" and det.num_tokens == len(out)
    assert max(windows) <= 10


def test_decode_equals_the_tokenizers_own_decode(tok: Tokenizer) -> None:
    """`Tokenizer.decode` (the Rust decoder straight, for a fast tokenizer) returns what `hf.decode` returns without
    clean-up, with and without special tokens, on random id runs (byte pieces, specials, partial characters)."""
    rng = random.Random(7)
    specials = sorted(tok.special_token_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tok.hf)) for _ in range(rng.randrange(1, 12))]
        if specials and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            want = tok.hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tok.decode(ids, skip_special_tokens=skip) == want, ids


def one_call_per_token_or_two_calls(tok: Tokenizer, prompt: Sequence[int], ids: Sequence[int], cut: int) -> None:
    one_by_one = stream(tok, prompt, ids)[1].text
    det = IncrementalDetokenizer(tok, prompt, SamplingParams())
    text = det.add_tokens_at_once(ids[:cut]) + det.add_tokens_at_once(ids[cut:])
    assert text == det.text == one_by_one, ids
    assert det.num_tokens == len(ids)


def test_all_at_once_gives_what_one_token_at_a_time_gives(tok: Tokenizer) -> None:
    # the deferred text of a FINAL_ONLY request, split once at a random point as a finish may split it; real texts
    # with characters split across tokens (SentencePiece's decode of random byte-fallback and special ids depends
    # on the window: one decode and per-token decodes differ there, and both from a full decode)
    rng = random.Random(1)
    prompt = tok.encode("Prompt: 你好")
    for text in [*TEXTS, " ".join(TEXTS)]:
        ids = tok.encode(text, add_special_tokens=False)
        one_call_per_token_or_two_calls(tok, prompt, ids, rng.randrange(len(ids) + 1))


def test_all_at_once_on_random_byte_level_tokens(gpt2: Tokenizer) -> None:
    # invalid UTF-8, incomplete characters at the end, special tokens: a byte-level decode is local
    rng = random.Random(2)
    prompt = gpt2.encode("Random:")
    for _ in range(100):
        ids = [rng.randrange(gpt2.vocab_size) for _ in range(rng.randrange(1, 40))]
        one_call_per_token_or_two_calls(gpt2, prompt, ids, rng.randrange(len(ids) + 1))
