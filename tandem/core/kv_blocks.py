"""Paged-KV block bookkeeping with prefix caching (plain Python; the tensors live in the model runner).

A request's KV lives in fixed-size blocks: block `req.block_ids[i]` holds positions `[i * block_size, (i + 1) *
block_size)`. A block that is full of computed tokens gets a chained hash

    hash(block i) = hash((hash(block i - 1), tuple(tokens of block i)))      (block -1 hashes to `ROOT_HASH`)

so equal hashes mean equal whole prefixes, and a later request whose prompt starts with the same full blocks reuses
them instead of recomputing. Invariants kept here:

* `ref_count(b)` == the number of requests holding `b` in their `block_ids`.
* Every block is in exactly one of: in use (ref > 0), the plain free list (ref 0, no hash), the evictable cache
  (ref 0, hash kept, least-recently-freed first).
* A block is shared (ref > 1) only when it is a cached, full block of computed tokens; requests write only positions
  `>= num_computed_tokens`, so shared blocks are never written.
* Plain free blocks are handed out lowest id first, so the blocks ever used are `[0, num_touched)`: on the host the
  pool's pages are committed on first write, and its resident memory follows that high-water mark (the most blocks
  in use or cached at once), never a walk round the whole pool. A FIFO free list touched every block in turn: a
  1,500-request soak with prefix caching off still committed the whole 11 GiB pool.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.request import Request

ROOT_HASH = 0x7A6E_D3B1  # the parent hash of block 0: any fixed int (int hashes are stable across processes)

BlockKey = tuple[int, tuple[int, ...]]  # (parent hash, tokens of the block): what a block hash is the hash of


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """Chained hash of one full block: `hash((parent_hash, tuple(tokens)))`."""
    return hash((parent_hash, tuple(tokens)))


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, accumulated over admissions that looked the cache up."""

    queries: int = 0  # tokens of the requests looked up
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` positions: allocation, sharing, eviction, rollback."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # set while the block is in the prefix cache
        self._key: list[BlockKey | None] = [None] * num_blocks  # what `_hash` hashes, to verify hits exactly
        self._free: list[int] = list(range(num_blocks))  # ref 0, no hash; a min-heap (sorted is one)
        self.num_touched = 0  # blocks [0, num_touched) have been allocated at least once
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; first = least recently freed
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_committed: dict[str, int] = {}  # request id -> leading blocks already offered to the cache

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (ref > 0)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_retained_blocks(self) -> int:
        """Cached blocks no request holds: the prefix cache's own memory, evicted only when plain free ones run out."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many requests hold `block_id`."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash under which `block_id` sits in the prefix cache, or None when it is not cached."""
        return self._hash[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold positions `[0, num_tokens)`."""
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------------------------------------- lifecycle
    def admit(
        self, req: Request, num_new_tokens: int | None = None, *, use_prefix_cache: bool = True
    ) -> bool:
        """Give a request without blocks its cached prefix plus blocks for its first chunk.

        Reuses the longest run of leading full blocks of `req.token_ids` found in the prefix cache, never all of the
        tokens (the last one is always computed, so its logits exist), and allocates blocks for the next
        `num_new_tokens` positions after it (None: up to the end of `token_ids`). On success sets
        `req.num_computed_tokens = req.num_cached_tokens = ` the cached tokens and `req.block_ids`; returns False and
        changes nothing (beyond memoising hashes in `req.block_hashes`) when the free blocks do not suffice.
        `use_prefix_cache=False` skips the lookup (e.g. a request that wants logprobs of every prompt token).
        """
        if req.block_ids:
            raise ValueError(f"request {req.request_id} already holds blocks {req.block_ids[:8]}...")
        lookup = self.enable_prefix_caching and use_prefix_cache
        hits = self._find_cached_prefix(req) if lookup else []
        num_cached = len(hits) * self.block_size
        remaining = req.num_tokens - num_cached
        end = num_cached + (remaining if num_new_tokens is None else min(remaining, num_new_tokens))
        num_new_blocks = self.num_blocks_for(end) - len(hits)
        revived = sum(1 for b in hits if self._ref[b] == 0)  # hits taken out of the evictable pool
        if num_new_blocks > self.num_free_blocks - revived:
            return False
        for b in hits:
            self._acquire_cached(b)
        req.block_ids = hits + [self._allocate() for _ in range(num_new_blocks)]
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        self._num_committed[req.request_id] = len(hits)
        if lookup:
            self.stats.queries += req.num_tokens
            self.stats.hits += num_cached
        return True

    def ensure_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow `req.block_ids` so positions `[0, num_tokens)` have blocks; False (no change) if blocks run short."""
        need = self.num_blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        req.block_ids.extend(self._allocate() for _ in range(need))
        return True

    def commit(self, req: Request) -> None:
        """Offer the blocks that became full of computed tokens to the prefix cache.

        Hashes only blocks not committed before (appending to `req.block_hashes`). A block whose content is already
        cached under another block id (two requests computed the same prefix at once) stays private and uncached.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = self._num_committed.get(req.request_id, 0)
        # blocks full of computed tokens that are known: never the drafts of a plan in flight (scheduling ahead)
        num_full = min(req.num_computed_tokens, len(req.token_ids) - req.num_tentative) // bs
        hashes = req.block_hashes
        for i in range(start, num_full):
            key = (hashes[i - 1] if i else ROOT_HASH, tuple(req.token_ids[i * bs : (i + 1) * bs]))
            if i == len(hashes):
                hashes.append(hash(key))
            block = req.block_ids[i]
            if self._hash[block] is None and hashes[i] not in self._cached:
                self._cached[hashes[i]] = block
                self._hash[block] = hashes[i]
                self._key[block] = key
        self._num_committed[req.request_id] = max(start, num_full)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Speculative rollback: release the trailing blocks that hold only positions `>= num_tokens`."""
        keep = self.num_blocks_for(num_tokens)
        if keep >= len(req.block_ids):
            return
        assert keep >= self._num_committed.get(req.request_id, 0), "truncating into committed (cached) blocks"
        for b in reversed(req.block_ids[keep:]):
            self._release(b)
        del req.block_ids[keep:]

    def free(self, req: Request) -> None:
        """Release all of `req`'s blocks; `req.block_ids` becomes [].

        Blocks are released last-first, so a request's tail blocks are evicted before its (more shareable) head.
        """
        for b in reversed(req.block_ids):
            self._release(b)
        req.block_ids = []
        self._num_committed.pop(req.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash: evictable blocks become plain free blocks, blocks in use stop being shareable."""
        for b in self._cached.values():
            self._hash[b] = None
            self._key[b] = None
        self._cached.clear()
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()

    # ------------------------------------------------------------------------------------------------ inner
    def _find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached run of leading full blocks, leaving at least one token uncached."""
        bs = self.block_size
        hashes = req.block_hashes
        hits: list[int] = []
        for i in range((req.num_tokens - 1) // bs):
            key = (hashes[i - 1] if i else ROOT_HASH, tuple(req.token_ids[i * bs : (i + 1) * bs]))
            if i == len(hashes):
                hashes.append(hash(key))
            block = self._cached.get(hashes[i])
            if block is None or self._key[block] != key:  # a miss, or a hash collision
                break
            hits.append(block)
        return hits

    def _acquire_cached(self, block: int) -> None:
        """One more holder of a cached block (reviving it from the evictable pool when nobody held it)."""
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _allocate(self) -> int:
        """Take a plain free block, else evict the least-recently-freed cached one (dropping its hash)."""
        if self._free:
            block = heapq.heappop(self._free)
            self.num_touched = max(self.num_touched, block + 1)
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            assert h is not None and self._cached.get(h) == block
            del self._cached[h]
            self._hash[block] = None
            self._key[block] = None
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        """One holder fewer; at zero a cached block becomes evictable (most recent), any other becomes free."""
        assert self._ref[block] > 0, f"block {block} released more often than acquired"
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)
