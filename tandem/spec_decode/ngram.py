"""Prompt lookup decoding: draft the tokens that followed the most recent earlier occurrence of the last n tokens.

Same rule as vLLM's n-gram proposer: try n = prompt_lookup_max down to prompt_lookup_min; the first n whose last-n
tokens occur earlier in prompt + output wins, and the drafts are the (up to K) tokens that followed the most recent
such occurrence. The search is one vectorised pass over an int32 copy of the request's tokens that the proposer
keeps and extends incrementally.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer


class TokenBuffer:
    """An int32 copy of a growing token list, extended with only the new tokens (amortised O(1) per token)."""

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.empty(max(capacity, 16), dtype=np.int32)  # [capacity]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The tokens seen so far (a view, valid until the next `sync`)."""
        return self._data[: self._len]  # [len]

    def sync(self, token_ids: Sequence[int]) -> None:
        """Make the buffer equal `token_ids`, copying only its unseen tail.

        Token lists only grow; if `token_ids` is shorter than the buffer or its last known token changed, the buffer
        is rebuilt from scratch.
        """
        n = len(token_ids)
        known = self._len
        if n < known or (known and int(token_ids[known - 1]) != int(self._data[known - 1])):
            known = 0
        if n == known:
            self._len = n
            return
        if n > self._data.shape[0]:
            grown = np.empty(max(n, 2 * self._data.shape[0]), dtype=np.int32)
            grown[:known] = self._data[:known]
            self._data = grown
        self._data[known:n] = np.asarray(token_ids[known:n], dtype=np.int32)
        self._len = n


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to `k` tokens that followed the most recent earlier occurrence of the longest matching tail n-gram.

    `tokens` is [L] int32. An occurrence ending at e < L - 1 matches with length m when
    tokens[e - j] == tokens[L - 1 - j] for j < m; the result is tokens[e + 1 : e + 1 + k] for the largest
    m = n in [min_n, max_n] that occurs, taking the largest such e. Empty when nothing matches.
    """
    length = tokens.shape[0]
    max_n = min(max_n, length - 1)
    if k <= 0 or max_n < min_n or max_n < 1:
        return tokens[:0]
    # [c] candidate end positions e < L - 1 (ascending) where the last token occurs
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return tokens[:0]
    match_len = np.ones(ends.size, dtype=np.int32)  # [c] matched tail length per candidate, capped at max_n
    alive = np.ones(ends.size, dtype=bool)  # [c] still matching at offset j
    for j in range(1, max_n):
        before = ends - j  # [c]
        alive &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[length - 1 - j])
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.flatnonzero(match_len >= best)[-1]])  # most recent occurrence of the best length
    return tokens[end + 1 : end + 1 + k]


class NgramProposer(Proposer):
    """Prompt lookup decoding over each request's own prompt + output (deterministic drafts, no probs)."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._buffers: dict[str, TokenBuffer] = {}

    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        """Draft for each request; syncs the request's token buffer with its new tokens (skipped when K = 0)."""
        out: dict[str, Drafts] = {}
        for req in batch:
            if req.max_drafts <= 0:
                out[req.request_id] = Drafts([])
                continue
            buf = self._buffers.get(req.request_id)
            if buf is None:
                buf = self._buffers[req.request_id] = TokenBuffer(2 * len(req.token_ids))
            buf.sync(req.token_ids)
            tokens = buf.tokens
            if req.assumed:  # searched past, never kept in the buffer
                tokens = np.concatenate([tokens, np.asarray(req.assumed, dtype=np.int32)])
            drafts = find_ngram_continuation(tokens, self.prompt_lookup_min, self.prompt_lookup_max, req.max_drafts)
            out[req.request_id] = Drafts(drafts.tolist())
        return out

    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        """Nothing to learn: the accepted tokens reach the buffer through the next `propose`."""

    def release(self, request_id: str) -> None:
        """Drop the request's token buffer."""
        self._buffers.pop(request_id, None)
