"""Prompt lookup (n-gram) drafting: matching rule, limits, incremental buffer against the rule on a 4k context, and a
simulated copy task. (Proposal latency is measured by `tandem bench spec`, not asserted here.)"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.spec_decode import DraftRequest, NgramProposer, make_proposer
from tandem.spec_decode.ngram import TokenBuffer, find_ngram_continuation


def propose(proposer: NgramProposer, tokens: list[int], k: int, request_id: str = "r") -> list[int]:
    return proposer.propose([DraftRequest(request_id, tokens, 1, k)])[request_id].token_ids


def test_repeated_text_proposes_continuation() -> None:
    p = NgramProposer()
    assert propose(p, [1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert propose(p, [1, 2, 3, 4, 5, 1, 2, 3], 10) == [4, 5, 1, 2, 3]  # runs up to the end of the context


def test_no_match_gives_empty_drafts() -> None:
    p = NgramProposer()
    assert propose(p, [1, 2, 3, 4], 5) == []
    assert propose(p, [7], 5, "single") == []
    drafts = p.propose([DraftRequest("x", [1, 2, 1], 1, 4)])["x"]
    assert drafts.token_ids == [2, 1]


def test_respects_max_drafts() -> None:
    p = NgramProposer()
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(p, tokens, 1) == [3]
    assert propose(p, tokens, 4) == [3, 4, 5, 6]
    assert propose(p, tokens, 0) == []  # K = 0: skipped, still answered


def test_longest_n_wins_then_most_recent_occurrence() -> None:
    tokens = [5, 1, 8, 2, 1, 9, 5, 1]
    assert propose(NgramProposer(1, 2), tokens, 1) == [8]  # 2-gram [5, 1] matches at the start
    assert propose(NgramProposer(1, 1), tokens, 1) == [9]  # 1-gram [1]: most recent occurrence
    assert propose(NgramProposer(3, 4), tokens, 1) == []  # no 3-gram repeats
    assert propose(NgramProposer(2, 4), [1, 2, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]


def test_min_n_rejects_short_matches() -> None:
    tokens = [3, 1, 4, 1]
    assert propose(NgramProposer(1, 4), tokens, 2) == [4, 1]
    assert propose(NgramProposer(2, 4), tokens, 2) == []


def test_overlapping_occurrence_is_allowed() -> None:
    assert propose(NgramProposer(1, 3), [9, 7, 7, 7, 7], 3) == [
        7
    ]  # [7,7,7] ends at index 3, followed by one 7


def test_invalid_lookup_bounds() -> None:
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)


def test_matches_brute_force() -> None:
    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(0, 6)
        expected: list[int] = []
        if k > 0:
            for n in range(hi, lo - 1, -1):
                tail = tokens[len(tokens) - n :] if n <= len(tokens) - 1 else None
                if tail is None:
                    continue
                ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tail]
                if ends:
                    expected = tokens[ends[-1] + 1 : ends[-1] + 1 + k]
                    break
        got = find_ngram_continuation(np.asarray(tokens, dtype=np.int32), lo, hi, k).tolist()
        assert got == expected, (tokens, lo, hi, k)


def test_buffer_extends_incrementally_and_rebuilds_on_change() -> None:
    buf = TokenBuffer(capacity=16)
    tokens = list(range(10))
    buf.sync(tokens)
    data_before = buf.tokens
    tokens += list(range(10, 40))  # outgrows the capacity
    buf.sync(tokens)
    assert buf.tokens.tolist() == tokens and data_before.tolist() == list(range(10))
    changed = [1, 2, 3]
    buf.sync(changed)
    assert buf.tokens.tolist() == changed


def test_state_is_per_request_and_released() -> None:
    p = NgramProposer()
    out = p.propose([DraftRequest("a", [1, 2, 1], 1, 2), DraftRequest("b", [4, 5, 6], 1, 2)])
    assert out["a"].token_ids == [2, 1] and out["b"].token_ids == []
    p.release("a")
    p.release("unknown")  # no error
    assert propose(p, [1, 2, 1], 2, "a") == [2, 1]


def test_registry() -> None:
    assert make_proposer("ngram", prompt_lookup_max=3).name == "ngram"
    with pytest.raises(ValueError, match="ngram.*suffix"):
        make_proposer("medusa")


def brute_force_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule read literally: for n = max_n down to min_n, the most recent earlier occurrence of the last n tokens
    (ending before the last token, overlaps allowed) -> the up to k tokens after it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tail:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_4k_context_incremental_drafts_match_the_rule() -> None:
    """A 4,096-token prompt, then 200 steps that alternately copy an earlier stretch and add a random token, as
    decoding does: every draft of the incremental proposer equals the rule applied from scratch (small vocabulary
    too, where many n-grams recur)."""
    for vocab, (lo, hi) in ((32000, (1, 4)), (50, (2, 3))):
        rng = random.Random(vocab)
        tokens = [rng.randrange(vocab) for _ in range(4096)]
        p = NgramProposer(lo, hi)
        planted = 0
        for i in range(200):
            got = propose(p, tokens, 5)
            assert got == brute_force_ngram(tokens, lo, hi, 5), (vocab, i)
            planted += bool(got)
            tokens.append(tokens[1000 + i] if i % 2 else rng.randrange(vocab))
        assert planted > 50  # the copied stretch was found, not just "no match" throughout


def copy_task_mean_accepted(proposer: NgramProposer, k: int = 5, seed: int = 0) -> float:
    """A target that copies a 400-token prompt with an edit every 37 tokens; returns mean accepted drafts/step."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(400)]
    target = [(t + 1) % 1000 if i % 37 == 36 else t for i, t in enumerate(prompt)]
    tokens = list(prompt)
    accepted_per_step = []
    while len(tokens) - len(prompt) < len(target):
        done = len(tokens) - len(prompt)
        drafts = proposer.propose([DraftRequest("copy", tokens, len(prompt), k)])["copy"].token_ids
        accepted = 0
        while (
            accepted < len(drafts)
            and done + accepted < len(target)
            and drafts[accepted] == target[done + accepted]
        ):
            accepted += 1
        proposer.on_verified("copy", drafts[:accepted], len(drafts))
        tokens += target[done : done + accepted + 1]  # accepted drafts + the target's own next token
        accepted_per_step.append(accepted)
    proposer.release("copy")
    return float(np.mean(accepted_per_step))


def test_copy_task_mean_accepted_length() -> None:
    mean = copy_task_mean_accepted(NgramProposer())
    print(f"ngram copy task: mean accepted drafts per step {mean:.2f}")
    assert mean > 2.0
