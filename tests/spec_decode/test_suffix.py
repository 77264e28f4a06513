"""Suffix decoding: the bounded-depth suffix trie (counts, incremental growth, removal) and the proposer."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from tandem.spec_decode import DraftRequest, SuffixProposer, SuffixTree, make_proposer
from tandem.spec_decode.native import native_suffix_tree
from tandem.spec_decode.suffix import MAX_UNCACHED, Cursor, NativeSuffixTree


@pytest.fixture(params=["python", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    """Each test runs on the Python trie and on the C++ one (csrc/suffix_tree.cpp)."""
    if request.param == "native" and native_suffix_tree() is None:
        pytest.skip("the native suffix tree does not build here (no C++ compiler)")
    return bool(request.param == "native")


def new_tree(depth: int, native: bool) -> SuffixTree | NativeSuffixTree:
    return NativeSuffixTree(depth) if native else SuffixTree(depth)


def brute_counts(seqs: Iterable[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every substring of length <= depth -> number of start positions whose depth-capped suffix contains it."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                key = tuple(s[i:j])
                out[key] = out.get(key, 0) + 1
    return out


def propose(
    p: SuffixProposer, tokens: list[int], k: int, request_id: str = "r", num_prompt: int = 1
) -> list[int]:
    return p.propose([DraftRequest(request_id, tokens, num_prompt, k)])[request_id].token_ids


# ---- SuffixTree ------------------------------------------------------------------------------------------------
def random_operations(rng: random.Random, trees: list[SuffixTree | NativeSuffixTree], vocab: int, num_ops: int,
                      max_len: int, num_seqs: int) -> Iterator[tuple[dict[int, list[int]], set[int]]]:
    """Random extends, finishes and removes, each applied to every tree of `trees`; yields (the sequences held,
    those finished) after each."""
    seqs: dict[int, list[int]] = {}
    finished: set[int] = set()
    for _ in range(num_ops):
        r = rng.random()
        if r < 0.6:
            sid = rng.randint(0, num_seqs - 1)
            if sid in finished:
                continue
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, max_len))]
            for tree in trees:
                tree.extend(sid, tokens)
            seqs.setdefault(sid, []).extend(tokens)
        elif r < 0.75 and seqs:
            sid = rng.choice(sorted(seqs))
            for tree in trees:
                tree.finish(sid)
            finished.add(sid)
        elif seqs:
            sid = rng.choice(sorted(seqs))
            for tree in trees:
                tree.remove(sid)
            del seqs[sid]
            finished.discard(sid)
        yield seqs, finished


def test_tree_counts_match_brute_force_under_growth_finish_and_removal(native: bool) -> None:
    rng = random.Random(0)
    for _ in range(150):
        depth = rng.randint(1, 7)
        vocab = rng.randint(1, 4)
        tree = new_tree(depth, native)
        for seqs, _ in random_operations(rng, [tree], vocab, rng.randint(1, 10), 6, 4):
            assert tree.counts() == brute_counts(seqs.values(), depth)


def test_incremental_growth_equals_rebuild_from_scratch(native: bool) -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(400)]
    incremental = new_tree(16, native)
    i = 0
    while i < len(tokens):
        step = rng.randint(1, 9)
        incremental.extend(0, tokens[i : i + step])
        i += step
    rebuilt = new_tree(16, native)
    rebuilt.extend(0, tokens)
    assert incremental.counts() == rebuilt.counts() == brute_counts([tokens], 16)
    assert incremental.growing_match(0).keys() == rebuilt.growing_match(0).keys()


def test_proposer_tree_updated_incrementally_equals_rebuild(native: bool) -> None:
    rng = random.Random(4)
    tokens = [rng.randrange(20) for _ in range(300)]
    p = SuffixProposer(native=native, max_tree_depth=12)
    n = 50
    while n < len(tokens):
        propose(p, tokens[:n], 4, num_prompt=50)
        n += rng.randint(1, 5)  # accepted drafts + bonus token
    propose(p, tokens, 4, num_prompt=50)
    rebuilt = new_tree(12, native)
    rebuilt.extend(0, tokens)
    assert p._requests["r"].tree.counts() == rebuilt.counts()


def test_removed_sequences_give_their_storage_back(native: bool) -> None:
    rng = random.Random(5)
    tree = new_tree(8, native)
    tree.extend(0, [rng.randrange(5) for _ in range(50)])
    peak = tree.num_points
    for sid in range(1, 40):  # a rolling cache: each sequence added, then removed
        tree.extend(sid, [rng.randrange(5) for _ in range(30)])
        tree.finish(sid)
        peak = max(peak, tree.num_points)
        tree.remove(sid)
        # what stays is sequence 0's (some of its leaves became count-1 nodes while shared), never the removed ones'
        assert tree.num_points <= 1 + 50 * 8
    # freed ids reused: storage follows the peak (nodes and leaves peak apart), not the 39 sequences added in all
    assert tree.capacity <= 2 * peak
    assert tree.counts() == brute_counts([tree.sequence(0)], 8)


def test_growing_match_reports_repeated_suffixes(native: bool) -> None:
    tree = new_tree(8, native)
    tree.extend(0, [1, 2, 3, 9, 1, 2])
    matches = tree.growing_match(0)
    assert sorted(matches) == [1, 2]  # [2] and [1, 2] occur twice; [9, 1, 2] once
    assert tree.node_count(matches[2]) == 2


def test_speculate_follows_most_frequent_continuation_and_stops_on_low_probability(native: bool) -> None:
    tree = new_tree(8, native)
    tree.extend(0, [1, 2, 5, 6, 0, 1, 2, 5, 7, 0, 1, 2, 4, 8])
    cursor = tree.walk([1, 2])
    assert cursor is not None
    draft = tree.speculate(cursor, 4, 0.1)
    assert draft.token_ids[:1] == [5]  # 5 follows [1, 2] twice, 4 once
    assert tree.speculate(cursor, 4, 0.5).token_ids == [5]  # then 6 or 7: cumulative 2/3 * 1/2 < 0.5
    assert tree.speculate(cursor, 4, 0.9).token_ids == []
    assert tree.walk([3]) is None


# ---- SuffixProposer --------------------------------------------------------------------------------------------
def test_own_tree_proposes_the_continuation(native: bool) -> None:
    p = SuffixProposer(native=native)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    # the output starts repeating the prompt: [10, 11, 12] matched (length 3) -> up to 3 drafts
    assert propose(p, [*prompt, 10, 11, 12], 8) == [13, 14, 15]
    assert propose(p, [*prompt, 10, 11, 12, 13, 14, 15], 8) == [16, 17, 18, 19, 10, 11]
    assert propose(p, [1, 2, 3], 8, "fresh") == []


def test_draft_length_grows_with_match_length(native: bool) -> None:
    source = list(range(100, 140))  # distinct tokens
    filler = list(range(500, 520))  # never seen in the source
    for factor in (1.0, 0.5):
        lengths = []
        for m in (1, 2, 4, 8):
            p = SuffixProposer(native=native, max_spec_factor=factor)
            tokens = [
                *source,
                *filler,
                *source[20 - m : 20],
            ]  # tail matches source[:20] over exactly m tokens
            drafts = propose(p, tokens, 16)
            assert drafts == source[20 : 20 + len(drafts)]
            lengths.append(len(drafts))
        assert lengths == [int(factor * m) for m in (1, 2, 4, 8)]


def test_global_tree_helps_a_second_request_with_the_same_output(native: bool) -> None:
    rng = random.Random(5)
    output = [rng.randrange(1000, 2000) for _ in range(60)]
    prompt_a = [rng.randrange(0, 1000) for _ in range(30)]
    prompt_b = [rng.randrange(0, 1000) for _ in range(30)]
    p = SuffixProposer(native=native)
    propose(p, [*prompt_a, *output], 4, "a", num_prompt=30)
    p.release("a")
    assert p.cached_request_ids == []  # cached by the next `tidy`, where the engine would wait for the device
    p.tidy(None)
    assert p.cached_request_ids == ["a"]
    context = [*prompt_b, *output[:10]]
    assert propose(p, context, 5, "b", num_prompt=30) == output[10:15]
    assert propose(SuffixProposer(native=native), context, 5, "b", num_prompt=30) == []  # nothing without the cache


def test_release_reads_the_final_tokens_from_the_live_view(native: bool) -> None:
    p = SuffixProposer(native=native)
    tokens = [1, 2, 3, 4, 5, 6]
    propose(p, tokens, 2, "a", num_prompt=3)
    tokens += [7, 8, 9]  # the engine's list grew after the last propose
    p.release("a")
    tokens += [10]  # the engine's list is read at release, not at tidy
    p.tidy(None)
    assert p.global_tree.sequence(0) == [4, 5, 6, 7, 8, 9]


def test_tidy_caches_what_fits_before_its_deadline_and_release_bounds_the_backlog(native: bool) -> None:
    p = SuffixProposer(native=native)
    for i in range(3):
        propose(p, [1, 2, 3, 10 + i, 11 + i], 2, f"r{i}", num_prompt=3)
        p.release(f"r{i}")
    p.tidy(time.perf_counter() - 1.0)  # a deadline passed: nothing
    assert p.cached_request_ids == []
    p.tidy(time.perf_counter() + 10.0)
    assert p.cached_request_ids == ["r0", "r1", "r2"]
    for i in range(MAX_UNCACHED + 2):  # beyond the backlog's bound, release caches the oldest waiting at once
        propose(p, [1, 2, 3, 4], 2, f"s{i}", num_prompt=3)
        p.release(f"s{i}")
    assert p.cached_request_ids == ["r0", "r1", "r2", "s0", "s1"]


def test_global_memory_is_bounded_lru(native: bool) -> None:
    rng = random.Random(6)
    outputs = {f"r{i}": [rng.randrange(50) for _ in range(40)] for i in range(4)}
    p = SuffixProposer(native=native, max_tree_depth=8, max_cached_requests=2)
    for rid, out in outputs.items():
        p.cache_output(rid, out)
    assert p.cached_request_ids == ["r2", "r3"]
    assert p.global_tree.num_sequences == 2
    assert p.global_tree.counts() == brute_counts([outputs["r2"], outputs["r3"]], 8)
    p.cache_output("r2", outputs["r2"])  # re-caching refreshes its place
    assert p.cached_request_ids == ["r3", "r2"]
    p.cache_output("r4", [1, 2, 3])
    assert p.cached_request_ids == ["r2", "r4"]
    assert p.global_tree.counts() == brute_counts([outputs["r2"], [1, 2, 3]], 8)
    disabled = SuffixProposer(native=native, max_cached_requests=0)
    propose(disabled, [1, 2, 3], 2, "x")
    disabled.release("x")
    assert disabled.global_tree.num_sequences == 0


def test_k_zero_and_registry(native: bool) -> None:
    p = make_proposer("suffix", max_tree_depth=16)
    assert p.name == "suffix"
    out = p.propose([DraftRequest("a", [1, 2, 1, 2], 1, 0)])
    assert out["a"].token_ids == []


def test_4k_context_incremental_drafts_equal_a_fresh_build_and_follow_the_planted_copy(native: bool) -> None:
    """A 4,096-token prompt of random tokens, then 200 decoding steps that copy tokens[1000:1200] back: the copy
    is the only earlier occurrence of the growing tail, so once the match is long enough every draft is that
    stretch's continuation; and the incrementally grown tree drafts exactly what a tree built from scratch over the
    same tokens drafts (checked every 10 steps)."""
    rng = random.Random(0)
    tokens = [rng.randrange(32000) for _ in range(4096)]
    p = SuffixProposer(native=native)
    assert propose(p, tokens, 5, num_prompt=4096) == []  # random tokens: nothing recurs yet
    for i in range(200):
        tokens.append(tokens[1000 + i])
        got = propose(p, tokens, 5, num_prompt=4096)
        if i >= 4:  # a match of >= 5 tokens allows 5 drafts (max_spec_factor 1)
            assert got == tokens[1001 + i : 1006 + i], i
        else:
            assert got == tokens[1001 + i : 1001 + i + len(got)] and len(got) <= i + 1, i
        if i % 10 == 0:
            assert propose(SuffixProposer(native=native), tokens, 5, num_prompt=4096) == got, i


def copy_task_mean_accepted(proposer: SuffixProposer, k: int = 5, seed: int = 0) -> float:
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


def test_copy_task_mean_accepted_length(native: bool) -> None:
    mean = copy_task_mean_accepted(SuffixProposer(native=native))
    print(f"suffix copy task: mean accepted drafts per step {mean:.2f}")
    assert mean > 2.0


# ---- the C++ trie against the Python one -----------------------------------------------------------------------
def _queries(tree: SuffixTree | NativeSuffixTree, rng: random.Random, vocab: int,
             seqs: dict[int, list[int]]) -> list[object]:
    """What a proposer reads from a tree, for contexts taken from the sequences held (most walks succeed) and
    random ones: matches, walks, drafts."""
    out: list[object] = []
    held = [seq for seq in seqs.values() if seq]
    for _ in range(8):
        if held and rng.random() < 0.75:
            seq = rng.choice(held)
            end = rng.randint(1, len(seq))
            context = seq[max(0, end - rng.randint(1, 12)) : end]
        else:
            context = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        k, factor, prob = rng.randint(1, 9), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        cursor = tree.walk(context)
        spec = tree.speculate(cursor, k, prob) if cursor is not None else None
        walked = tree.best_walked(context, k, factor, prob)
        out += [tree.longest_match(context, 9), cursor, None if spec is None else (spec.token_ids, spec.score),
                (walked.token_ids, walked.score, walked.match_length)]
    return out


def test_native_and_python_tries_hold_and_answer_alike() -> None:
    """The same operations on both: the same strings and counts, the same node ids and free-list reuse (the C++ trie
    mirrors the Python one's allocation), the same walks and drafts (ties broken by insertion order in both)."""
    if native_suffix_tree() is None:
        pytest.skip("the native suffix tree does not build here (no C++ compiler)")
    rng = random.Random(7)
    for _ in range(120):
        depth, vocab = rng.randint(1, 9), rng.randint(1, 40)  # > 16 children: the C++ index by token too
        py_tree, c_tree = SuffixTree(depth), NativeSuffixTree(depth)
        for seqs, finished in random_operations(rng, [py_tree, c_tree], vocab, rng.randint(1, 14), 30, 5):
            assert c_tree.counts() == py_tree.counts()
            assert (c_tree.num_points, c_tree.capacity, c_tree.num_sequences) == (
                py_tree.num_points, py_tree.capacity, py_tree.num_sequences)
            for sid in sorted(set(seqs) - finished):
                assert c_tree.growing_match(sid) == py_tree.growing_match(sid)
                k, factor, prob = rng.randint(1, 9), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
                a, b = c_tree.best_own(sid, k, factor, prob), py_tree.best_own(sid, k, factor, prob)
                assert (a.token_ids, a.score, a.match_length) == (b.token_ids, b.score, b.match_length)
                assert c_tree.tail(sid, 5) == py_tree.tail(sid, 5) and c_tree.length(sid) == py_tree.length(sid)
            seed = rng.random()
            assert _queries(c_tree, random.Random(seed), vocab, seqs) == _queries(py_tree, random.Random(seed), vocab, seqs)
    assert Cursor(node=0) == NativeSuffixTree(4).walk([])


def test_native_and_python_proposers_draft_alike_over_many_requests() -> None:
    """Requests that copy from their prompts and from each other's outputs, finishing and cached in the global
    trie as they go: every draft the same from both proposers."""
    if native_suffix_tree() is None:
        pytest.skip("the native suffix tree does not build here (no C++ compiler)")
    rng = random.Random(11)
    phrases = [[rng.randrange(300) for _ in range(rng.randint(3, 12))] for _ in range(20)]
    proposers = [SuffixProposer(max_tree_depth=16, max_cached_requests=6, native=n) for n in (True, False)]
    for i in range(30):
        tokens = [t for _ in range(8) for t in rng.choice(phrases)]
        prompt = len(tokens)
        while len(tokens) < prompt + 80:
            k = rng.randint(0, 6)
            assumed = [rng.randrange(300)] if rng.random() < 0.3 else []
            batch = [DraftRequest(f"r{i}", list(tokens), prompt, k, assumed)]
            got = [p.propose(batch)[f"r{i}"].token_ids for p in proposers]
            assert got[0] == got[1], (i, len(tokens))
            tokens += got[0][: rng.randint(0, len(got[0]))] + rng.choice(phrases)[:2]
        for p in proposers:
            p.release(f"r{i}")
            p.tidy(None)
    assert proposers[0].cached_request_ids == proposers[1].cached_request_ids
