"""SuffixDecoding (Arctic Inference): draft by following the most frequent continuation in suffix trees.

Each request has a suffix tree over its own prompt + output (extended as tokens arrive), and one global tree holds
the outputs of the last `max_cached_requests` finished requests. A step matches the longest suffix of the request's
tokens in both trees, grows a draft along the most frequent continuation (at most max_spec_factor * match_length
tokens, stopping once the draft's empirical probability falls below min_token_prob) and keeps the draft with the
larger expected number of accepted tokens.

`SuffixTree` is a suffix trie of bounded depth D with occurrence counts: for every sequence s and start i it holds
the path s[i : i + D], and the count of a point (a string) is the number of such paths through or ending at it.
Points with count 1 lie on one path only, so they are not stored as nodes: a leaf stands for that path's unique
tail and reads its tokens from the sequence itself ("once a leaf, always a leaf" as in suffix trees), growing with
it for free. Appending a token costs O(number of the sequence's suffixes that occur elsewhere) <= O(D).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.spec_decode.native import native_suffix_tree
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer

# finished outputs waiting for `tidy` beyond this many are cached at once by `release`: bounded memory and staleness
MAX_UNCACHED = 256


@dataclass
class Cursor:
    """A matched point: an explicit node id, or a position inside a leaf (`next_pos` = index of its next token)."""

    node: int | None = None
    leaf: int | None = None
    next_pos: int = 0


@dataclass
class Draft:
    """A speculated continuation and its score: the sum over its tokens of their cumulative probability."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0
    match_length: int = 0


class SuffixTree:
    """A bounded-depth suffix trie with counts over several token sequences (ids chosen by the caller).

    Storage is plain ints: node `n` has `_count[n]` and `_children[n]` (token -> child code); a child code >= 0 is a
    node id, a code < 0 is `~leaf` for leaf id `leaf` with `_leaf_seq/_leaf_start/_leaf_pos[leaf]`. Dicts and lists
    of ints hold no references the cyclic GC follows (CPython leaves int-only dicts untracked), so a trie of a million
    points costs a full collection one list walk, where one object per point cost 26.6 ms per 160,000 points
    (measured: `tandem bench simulated --modes suffix` at 256 requests spent 6 ms a step in collections).
    Freed ids are reused.
    """

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._count: list[int] = [0]  # node 0 = the root
        self._children: list[dict[int, int]] = [{}]
        self._free_nodes: list[int] = []
        self._leaf_seq: list[int] = []
        self._leaf_start: list[int] = []
        self._leaf_pos: list[int] = []
        self._free_leaves: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        # seq_id -> {start: node where path (seq_id, start) ends}, for the growing paths (depth < D) whose end is an
        # explicit node. Growing paths not listed end inside their own leaf. Absent for finished sequences.
        self._growing: dict[int, dict[int, int]] = {}

    # ---- storage -----------------------------------------------------------------------------------------------
    def _new_node(self, count: int) -> int:
        if self._free_nodes:
            node = self._free_nodes.pop()
            self._count[node] = count
            return node
        self._count.append(count)
        self._children.append({})
        return len(self._count) - 1

    def _new_leaf(self, seq_id: int, start: int, pos: int) -> int:
        """A leaf's child code (< 0)."""
        if self._free_leaves:
            leaf = self._free_leaves.pop()
            self._leaf_seq[leaf], self._leaf_start[leaf], self._leaf_pos[leaf] = seq_id, start, pos
        else:
            leaf = len(self._leaf_seq)
            self._leaf_seq.append(seq_id)
            self._leaf_start.append(start)
            self._leaf_pos.append(pos)
        return ~leaf

    def _free(self, code: int) -> None:
        """Return the ids of the subtree under child code `code` to the free lists (it is already unlinked)."""
        stack = [code]
        while stack:
            code = stack.pop()
            if code < 0:
                self._free_leaves.append(~code)
                continue
            children = self._children[code]
            stack.extend(children.values())
            children.clear()
            self._free_nodes.append(code)

    def _leaf_end(self, leaf: int) -> int:
        """One past the last sequence index leaf `leaf` covers (it grows with a growing sequence)."""
        return min(self._leaf_start[leaf] + self.max_depth, len(self._seqs[self._leaf_seq[leaf]]))

    # ---- updates -----------------------------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq_id` (created if new): every suffix of it gains the new tokens."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._growing[seq_id] = {}
        growing = self._growing.get(seq_id)
        if growing is None:
            raise ValueError(f"sequence {seq_id} was finished; it cannot grow")
        for token in tokens:
            self._append(seq_id, seq, growing, int(token))

    def finish(self, seq_id: int) -> None:
        """Freeze sequence `seq_id` (drops its growth bookkeeping; it stays in the tree until `remove`)."""
        self._growing.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        """Delete all paths of sequence `seq_id`: counts drop along them and points left with count 0 go."""
        seq = self._seqs[seq_id]
        self._growing.pop(seq_id, None)
        depth = self.max_depth
        count, all_children = self._count, self._children
        for start in range(len(seq)):
            node = 0
            for pos in range(start, min(start + depth, len(seq))):
                token = seq[pos]
                children = all_children[node]
                child = children[token]
                if child < 0:
                    assert self._leaf_seq[~child] == seq_id and self._leaf_start[~child] == start, "leaf of another path"
                    del children[token]
                    self._free(child)
                    break
                count[child] -= 1
                if count[child] == 0:
                    del children[token]  # the rest of the path hangs below and goes with it
                    self._free(child)
                    break
                node = child
        del self._seqs[seq_id]  # after the walk: the leaves freed above read its length

    def _append(self, seq_id: int, seq: list[int], growing: dict[int, int], token: int) -> None:
        """seq += [token]: the paths ending at explicit nodes step to their `token` child, plus a new path."""
        pos = len(seq)
        seq.append(token)  # paths ending inside leaves of this sequence grow with it, no work
        complete = pos + 1 - self.max_depth  # paths starting at or before this reach depth D with this token
        paths = list(growing.items())
        paths.append((pos, 0))
        all_children, count = self._children, self._count
        for start, node in paths:
            children = all_children[node]
            child = children.get(token)
            if child is None:
                children[token] = self._new_leaf(seq_id, start, pos)  # first occurrence: a unique tail
                if start != pos:
                    del growing[start]
                continue
            if child < 0:
                child = self._split(node, token, ~child)
            count[child] += 1
            if start <= complete:
                growing.pop(start, None)
            else:
                growing[start] = child

    def _split(self, parent: int, token: int, leaf: int) -> int:
        """Make the first point of `leaf` (under `parent` via `token`) an explicit node holding the leaf's count 1."""
        node = self._new_node(1)
        self._children[parent][token] = node
        pos = self._leaf_pos[leaf] = self._leaf_pos[leaf] + 1
        if pos < self._leaf_end(leaf):
            self._children[node][self._seqs[self._leaf_seq[leaf]][pos]] = ~leaf
        else:
            # the leaf's path ends at the new node; if it still grows it is tracked as ending at an explicit node
            self._free_leaves.append(leaf)
            start = self._leaf_start[leaf]
            growing = self._growing.get(self._leaf_seq[leaf])
            if growing is not None and pos - start < self.max_depth:
                growing[start] = node
        return node

    # ---- queries -----------------------------------------------------------------------------------------------
    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of `seq_id` (the tree's own list; do not modify)."""
        return self._seqs[seq_id]

    def length(self, seq_id: int) -> int:
        """How many tokens `seq_id` holds (0 for an unknown one)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else len(seq)

    def tail(self, seq_id: int, n: int) -> list[int]:
        """The last `n` tokens of `seq_id` (all of them when it is shorter)."""
        seq = self._seqs[seq_id]
        return seq[max(0, len(seq) - n) :]

    @property
    def capacity(self) -> int:
        """Node and leaf ids ever allocated (freed ones are reused: this stays near the peak of `num_points`)."""
        return len(self._count) + len(self._leaf_seq)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_points(self) -> int:
        """Explicit nodes (the root included) and leaves held now; ids freed by `remove` are not counted."""
        return len(self._count) - len(self._free_nodes) + len(self._leaf_seq) - len(self._free_leaves)

    def node_count(self, node: int) -> int:
        """How many stored paths pass through or end at explicit node `node`."""
        return self._count[node]

    def walk(self, tokens: Sequence[int]) -> Cursor | None:
        """The point for string `tokens` (a path from the root), or None if no sequence contains it."""
        node = 0
        all_children = self._children
        for i, token in enumerate(tokens):
            child = all_children[node].get(token)
            if child is None:
                return None
            if child < 0:
                leaf = ~child
                pos = self._leaf_pos[leaf]
                stop = pos + len(tokens) - i
                seq = self._seqs[self._leaf_seq[leaf]]
                if stop > self._leaf_end(leaf) or seq[pos:stop] != list(tokens[i:]):
                    return None
                return Cursor(leaf=leaf, next_pos=stop)
            node = child
        return Cursor(node=node)

    def longest_match(self, context: Sequence[int], max_length: int) -> int:
        """The largest m <= max_length such that context[-m:] occurs in the tree (0 if none).

        Occurrence is monotone in m (every substring of a stored string is stored while m <= D), so this is a
        binary search with O(log D) walks.
        """
        lo, hi = 0, min(max_length, len(context), self.max_depth)
        n = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.walk(context[n - mid :]) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def speculate(self, cursor: Cursor, max_tokens: int, min_token_prob: float) -> Draft:
        """Follow the most frequent continuation from `cursor` for up to `max_tokens` tokens.

        A token's probability is its child's count over the counts of all children (occurrences that continue);
        the draft stops before the cumulative probability falls below `min_token_prob`.
        """
        draft = Draft()
        prob = 1.0
        node, leaf, next_pos = cursor.node, cursor.leaf, cursor.next_pos
        count = self._count
        while len(draft.token_ids) < max_tokens:
            if leaf is not None:  # a unique tail: every next token has probability 1
                stop = min(self._leaf_end(leaf), next_pos + max_tokens - len(draft.token_ids))
                take = self._seqs[self._leaf_seq[leaf]][next_pos:stop]
                draft.token_ids.extend(take)
                draft.score += prob * len(take)
                break
            assert node is not None
            children = self._children[node]
            if not children:
                break
            best_token, best_child, best_count, total = -1, 0, 0, 0
            for token, child in children.items():
                c = count[child] if child >= 0 else 1
                total += c
                if c > best_count:
                    best_token, best_child, best_count = token, child, c
            prob *= best_count / total
            if prob < min_token_prob:
                break
            draft.token_ids.append(best_token)
            draft.score += prob
            if best_child < 0:
                leaf = ~best_child
                next_pos = self._leaf_pos[leaf] + 1
            else:
                node = best_child
        return draft

    def best_own(self, seq_id: int, max_drafts: int, spec_factor: float, min_token_prob: float) -> Draft:
        """The best draft (highest score; the first of equals) continuing growing sequence `seq_id` from its own
        matches: at the longest match m and, when shorter, at min(m, D - max_drafts), since a bounded-depth path
        stops at depth D. Each draft is at most `spec_factor` x its match length long."""
        best = Draft()
        own = self.growing_match(seq_id)
        if own:
            for m in match_lengths(max(own), max_drafts, self.max_depth):
                node = own.get(m)
                if node is not None:
                    best = _better(best, self.speculate(Cursor(node=node), spec_tokens(m, max_drafts, spec_factor),
                                                        min_token_prob), m)
        return best

    def best_walked(self, context: Sequence[int], max_drafts: int, spec_factor: float, min_token_prob: float) -> Draft:
        """The best draft continuing `context` (its last D tokens count), at the longest match of its tail in this
        tree and, when shorter, at min(m, D - max_drafts)."""
        best = Draft()
        longest = self.longest_match(context, self.max_depth)
        for m in match_lengths(longest, max_drafts, self.max_depth):
            cursor = self.walk(context[len(context) - m :])
            if cursor is not None:
                best = _better(best, self.speculate(cursor, spec_tokens(m, max_drafts, spec_factor), min_token_prob), m)
        return best

    def growing_match(self, seq_id: int) -> dict[int, int]:
        """For a growing sequence: match length m -> node id of its suffix of length m, for suffixes occurring >= 2x."""
        seq_len = len(self._seqs[seq_id])
        return {seq_len - start: node for start, node in self._growing.get(seq_id, {}).items()}

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored string -> its count (the canonical content, independent of how it was built)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while stack:
            node, prefix = stack.pop()
            for token, child in self._children[node].items():
                string = (*prefix, token)
                if child < 0:
                    leaf = ~child
                    out[string] = 1
                    seq = self._seqs[self._leaf_seq[leaf]]
                    for t in seq[self._leaf_pos[leaf] + 1 : self._leaf_end(leaf)]:
                        string = (*string, t)
                        out[string] = 1
                else:
                    out[string] = self._count[child]
                    stack.append((child, string))
        return out


def match_lengths(longest: int, max_drafts: int, depth: int) -> list[int]:
    """The match lengths a draft is tried at: the longest match, then min(longest, D - max_drafts); those >= 1."""
    return [m for m in sorted({longest, min(longest, depth - max_drafts)}, reverse=True) if m >= 1]


def spec_tokens(match_length: int, max_drafts: int, spec_factor: float) -> int:
    """A draft's length limit: at most `spec_factor` x its match length, and `max_drafts`."""
    return min(max_drafts, int(spec_factor * match_length + 1e-9))


def _better(best: Draft, draft: Draft, match_length: int) -> Draft:
    draft.match_length = match_length
    return draft if draft.score > best.score else best


class NativeSuffixTree:
    """`SuffixTree`'s interface over the C++ trie (`csrc/suffix_tree.cpp`: the same structure and the same drafts;
    on the AVX2 EPYC 3-5x less time per token appended 4 at a time and ~4x less per `propose`, the rest being the
    calls themselves: scripts/bench_suffix_tree.py). Made by `new_suffix_tree` when the native module builds here."""

    def __init__(self, max_depth: int = 64, native: Any = None) -> None:
        cls = native or native_suffix_tree()
        if cls is None:
            raise RuntimeError("the native suffix tree is not available here")
        self._tree = cls(max_depth)
        self.max_depth = max_depth

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._tree.extend(seq_id, tokens)

    def finish(self, seq_id: int) -> None:
        self._tree.finish(seq_id)

    def remove(self, seq_id: int) -> None:
        self._tree.remove(seq_id)

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of `seq_id` (a copy)."""
        return list(self._tree.sequence(seq_id))

    def length(self, seq_id: int) -> int:
        return int(self._tree.length(seq_id))

    def tail(self, seq_id: int, n: int) -> list[int]:
        return list(self._tree.tail(seq_id, n))

    def __contains__(self, seq_id: int) -> bool:
        return bool(self._tree.__contains__(seq_id))

    @property
    def num_sequences(self) -> int:
        return int(self._tree.num_sequences)

    @property
    def num_points(self) -> int:
        return int(self._tree.num_points)

    @property
    def capacity(self) -> int:
        return int(self._tree.capacity)

    def node_count(self, node: int) -> int:
        return int(self._tree.node_count(node))

    def walk(self, tokens: Sequence[int]) -> Cursor | None:
        got = self._tree.walk(list(tokens))
        if got is None:
            return None
        node, leaf, next_pos = got
        return Cursor(leaf=leaf, next_pos=next_pos) if leaf >= 0 else Cursor(node=node)

    def longest_match(self, context: Sequence[int], max_length: int) -> int:
        return int(self._tree.longest_match(list(context), max_length))

    def speculate(self, cursor: Cursor, max_tokens: int, min_token_prob: float) -> Draft:
        node = -1 if cursor.node is None else cursor.node
        leaf = -1 if cursor.leaf is None else cursor.leaf
        tokens, score = self._tree.speculate(node, leaf, cursor.next_pos, max_tokens, min_token_prob)
        return Draft(tokens, score)

    def growing_match(self, seq_id: int) -> dict[int, int]:
        return dict(self._tree.growing_match(seq_id))

    def counts(self) -> dict[tuple[int, ...], int]:
        return dict(self._tree.counts())

    def best_own(self, seq_id: int, max_drafts: int, spec_factor: float, min_token_prob: float) -> Draft:
        tokens, score, m = self._tree.best_own(seq_id, max_drafts, spec_factor, min_token_prob)
        return Draft(tokens, score, m)

    def best_walked(self, context: Sequence[int], max_drafts: int, spec_factor: float, min_token_prob: float) -> Draft:
        tokens, score, m = self._tree.best_walked(context, max_drafts, spec_factor, min_token_prob)
        return Draft(tokens, score, m)


def new_suffix_tree(max_depth: int, native: bool = True) -> SuffixTree | NativeSuffixTree:
    """A suffix trie: the native one when `native` and it builds here, else the Python one (the same drafts)."""
    cls = native_suffix_tree() if native else None
    return NativeSuffixTree(max_depth, cls) if cls is not None else SuffixTree(max_depth)


@dataclass
class _RequestState:
    tree: SuffixTree | NativeSuffixTree  # sequence 0 = the request's prompt + output as far as seen
    view: Sequence[int]  # the engine's latest token_ids (read again at release for the final output)
    num_prompt_tokens: int


class SuffixProposer(Proposer):
    """Suffix decoding over each request's own tokens and the outputs of recently finished requests."""

    name = "suffix"

    def __init__(
        self,
        max_tree_depth: int = 64,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        native: bool = True,
    ) -> None:
        """`native`: the C++ trie where it builds (the same drafts as the Python one, which tests pass False for)."""
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.native = native
        self.global_tree = new_suffix_tree(max_tree_depth, native)
        self._cached: OrderedDict[str, int] = OrderedDict()  # request id -> global sequence id, oldest first
        self._next_seq_id = 0
        self._requests: dict[str, _RequestState] = {}
        # finished requests' outputs not yet in the global tree (oldest first), and one caching's cost, smoothed:
        # caching a ~130-token output took ~0.2 ms (AMD EPYC), and 256 requests finishing within a few steps put
        # several ms of it into single steps (docs/benchmarks.md, issue 25)
        self._uncached: deque[tuple[str, list[int]]] = deque()
        self._cache_s = 0.0

    # ---- Proposer ----------------------------------------------------------------------------------------------
    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        """Draft for each request; a request with K > 0 first extends its own tree with the tokens it has not seen
        (with K = 0 only its token view is kept, for `release`)."""
        out: dict[str, Drafts] = {}
        for req in batch:
            state = self._state(req)
            if req.max_drafts <= 0:
                out[req.request_id] = Drafts([])
                continue
            self._sync_tree(state)
            out[req.request_id] = Drafts(self._draft(state, req.max_drafts, req.assumed).token_ids)
        return out

    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        """Nothing to do: accepted tokens reach the request's tree through the next `propose`."""

    def release(self, request_id: str) -> None:
        """Drop the request's tree; its output goes into the global tree at the next `tidy` (at once beyond
        `MAX_UNCACHED` waiting)."""
        state = self._requests.pop(request_id, None)
        if state is None or self.max_cached_requests == 0:
            return
        output = [int(t) for t in state.view[state.num_prompt_tokens :]]
        if output:
            self._uncached.append((request_id, output))
        if len(self._uncached) > MAX_UNCACHED:
            self.cache_output(*self._uncached.popleft())

    def tidy(self, deadline: float | None) -> None:
        """Cache the finished outputs waiting, oldest first, while one more fits before `deadline` (all: None)."""
        while self._uncached:
            t0 = time.perf_counter()
            if deadline is not None and t0 + self._cache_s > deadline:
                return
            self.cache_output(*self._uncached.popleft())
            took = time.perf_counter() - t0
            self._cache_s = took if self._cache_s == 0.0 else self._cache_s + 0.25 * (took - self._cache_s)

    # ---- global cache ------------------------------------------------------------------------------------------
    def cache_output(self, request_id: str, output: Sequence[int]) -> None:
        """Add `output` to the global tree as the newest entry; evicts least recently cached requests."""
        old = self._cached.pop(request_id, None)
        if old is not None:
            self.global_tree.remove(old)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.global_tree.extend(seq_id, output)
        self.global_tree.finish(seq_id)
        self._cached[request_id] = seq_id
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self.global_tree.remove(evicted)

    @property
    def cached_request_ids(self) -> list[str]:
        """Request ids whose outputs are in the global tree, oldest first."""
        return list(self._cached)

    # ---- drafting ----------------------------------------------------------------------------------------------
    def _state(self, req: DraftRequest) -> _RequestState:
        """The request's state (created on first sight) pointing at its latest token view."""
        state = self._requests.get(req.request_id)
        if state is None:
            state = self._requests[req.request_id] = _RequestState(
                new_suffix_tree(self.max_tree_depth, self.native), req.token_ids, req.num_prompt_tokens
            )
            state.tree.extend(0, [])
        state.view = req.token_ids
        return state

    def _sync_tree(self, state: _RequestState) -> None:
        """Extend the request's tree with the unseen tail of its view (rebuilt if the view no longer extends it)."""
        tokens = state.view
        known = state.tree.length(0)
        if len(tokens) < known or (known and int(tokens[known - 1]) != state.tree.tail(0, 1)[0]):
            state.tree = new_suffix_tree(self.max_tree_depth, self.native)
            known = 0
        if len(tokens) > known or known == 0:
            state.tree.extend(0, [int(t) for t in tokens[known:]])

    def _draft(self, state: _RequestState, max_drafts: int, assumed: Sequence[int] = ()) -> Draft:
        """The better (higher expected accepted count; the first of equals) of the drafts from the request's tree and
        the global tree, continuing the request's tokens (and `assumed` after them: matched, never inserted). The
        request's own tree is matched by its growing paths, or, with `assumed`, by walking."""
        depth = self.max_tree_depth
        args = (max_drafts, self.max_spec_factor, self.min_token_prob)
        tree = state.tree
        if assumed:
            context = [*tree.tail(0, depth), *(int(t) for t in assumed)]
            best = tree.best_walked(context, *args)
        else:
            context = tree.tail(0, depth)
            best = tree.best_own(0, *args)
        if self.global_tree.num_sequences:
            other = self.global_tree.best_walked(context, *args)
            best = other if other.score > best.score else best
        return best
