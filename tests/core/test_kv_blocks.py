"""BlockManager: allocation, prefix-cache sharing, LRU eviction, rollback, and the no-caching mode."""

from __future__ import annotations

import pytest

from tandem.core.kv_blocks import ROOT_HASH, BlockManager, hash_block
from tandem.params import SamplingParams
from tandem.request import Request

BS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams())


def compute_all(bm: BlockManager, req: Request) -> None:
    """Pretend a forward pass computed every token but the last, then commit (what the scheduler does)."""
    assert bm.ensure_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens - 1
    bm.commit(req)


def prefix(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def test_allocate_and_free_returns_all_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", prefix(40))
    assert bm.admit(req)
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert req.num_computed_tokens == 0 and req.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert all(bm.ref_count(b) == 1 for b in req.block_ids)
    bm.free(req)
    assert req.block_ids == []
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_free_blocks_are_reused_lowest_first_so_the_touched_blocks_stay_at_the_peak() -> None:
    """1,000 requests of 3 blocks, 4 at a time, no prefix cache: the blocks ever used stay the 12 of the peak (a FIFO
    free list walked the whole pool: every page of a host KV cache committed in turn)."""
    bm = BlockManager(num_blocks=1000, block_size=BS, enable_prefix_caching=False)
    live: list[Request] = []
    for i in range(1000):
        req = make_request(f"r{i}", prefix(40, base=i))
        assert bm.admit(req)
        live.append(req)
        if len(live) == 4:
            bm.free(live.pop(0))
        assert bm.num_used_blocks == 3 * len(live)
    assert bm.num_touched == 12 and bm.num_retained_blocks == 0


def test_retained_blocks_are_the_prefix_caches_own() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    req = make_request("a", prefix(40))
    assert bm.admit(req)
    compute_all(bm, req)
    bm.free(req)
    assert (bm.num_used_blocks, bm.num_retained_blocks, bm.num_touched) == (0, 2, 3)  # 2 full blocks kept, 3 written


def test_admit_allocates_only_first_chunk_and_ensure_slots_grows() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", prefix(100))
    assert bm.admit(req, 20)  # first chunk: positions [0, 20) -> 2 blocks
    assert len(req.block_ids) == 2
    assert bm.ensure_slots(req, 32)  # still 2 blocks
    assert len(req.block_ids) == 2
    assert bm.ensure_slots(req, 33)
    assert len(req.block_ids) == 3


def test_ensure_slots_and_admit_fail_without_change() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", prefix(40))
    assert bm.admit(a)
    before = list(a.block_ids)
    assert not bm.ensure_slots(a, 5 * BS + 1)  # needs 6 blocks, only 4 exist
    assert a.block_ids == before and bm.num_free_blocks == 1
    b = make_request("b", prefix(40, base=5000))
    assert not bm.admit(b)  # needs 3, 1 free
    assert b.block_ids == [] and b.num_computed_tokens == 0 and bm.num_free_blocks == 1


def test_block_hashes_are_chained() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    toks = prefix(50)
    req = make_request("a", toks)
    assert bm.admit(req)
    compute_all(bm, req)  # 49 computed -> 3 full blocks
    h0 = hash_block(ROOT_HASH, toks[0:16])
    h1 = hash_block(h0, toks[16:32])
    h2 = hash_block(h1, toks[32:48])
    assert req.block_hashes == [h0, h1, h2]
    assert [bm.block_hash(b) for b in req.block_ids] == [h0, h1, h2, None]
    assert bm.num_cached_blocks == 3


def test_commit_hashes_only_new_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", prefix(80))
    assert bm.admit(req)
    req.num_computed_tokens = 20
    bm.commit(req)
    assert len(req.block_hashes) == 1
    req.num_computed_tokens = 31  # block 1 not full of computed tokens yet
    bm.commit(req)
    assert len(req.block_hashes) == 1
    req.num_computed_tokens = 70
    bm.commit(req)
    assert len(req.block_hashes) == 4
    assert bm.num_cached_blocks == 4


def test_prefix_hit_shares_blocks_and_ref_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = prefix(64)
    a = make_request("a", shared + [1, 2, 3, 4, 5])
    assert bm.admit(a)
    compute_all(bm, a)
    b = make_request("b", shared + [9, 9, 9])
    assert bm.admit(b)
    assert b.num_cached_tokens == 64 and b.num_computed_tokens == 64
    assert b.block_ids[:4] == a.block_ids[:4]
    assert b.block_ids[4] != a.block_ids[4]
    assert all(bm.ref_count(x) == 2 for x in a.block_ids[:4])
    assert bm.ref_count(a.block_ids[4]) == 1 and bm.ref_count(b.block_ids[4]) == 1
    # shared blocks are full of tokens both requests have computed: nobody writes below num_computed_tokens
    for r in (a, b):
        first_written_block = r.num_computed_tokens // BS
        assert all(bm.ref_count(x) == 1 for x in r.block_ids[first_written_block:])
    assert bm.stats.queries == 69 + 67 and bm.stats.hits == 64
    bm.free(a)
    assert all(bm.ref_count(x) == 1 for x in b.block_ids[:4])
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_fully_cached_prompt_still_computes_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", prefix(80))
    assert bm.admit(a)
    a.num_computed_tokens = 80  # all 5 blocks full of computed tokens
    bm.commit(a)
    assert bm.num_cached_blocks == 5
    # exactly 4 cached blocks: the 4th must be recomputed for the prompt's last token
    same = make_request("b", prefix(64))
    assert bm.admit(same)
    assert same.num_cached_tokens == 48
    assert same.block_ids[:3] == a.block_ids[:3] and same.block_ids[3] != a.block_ids[3]
    longer = make_request("c", prefix(65))
    assert bm.admit(longer)
    assert longer.num_cached_tokens == 64 and longer.num_tokens - longer.num_computed_tokens == 1


def test_evictable_block_revived_by_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prefix(40))
    assert bm.admit(a)
    compute_all(bm, a)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 8  # evictable blocks count as free
    assert all(bm.block_hash(x) is not None for x in cached)
    b = make_request("b", prefix(40))
    assert bm.admit(b)
    assert b.block_ids[:2] == cached and b.num_cached_tokens == 32
    assert bm.num_free_blocks == 5


def test_admit_counts_revived_blocks_against_free_space() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", prefix(33))
    assert bm.admit(a)
    compute_all(bm, a)  # blocks 0, 1 cached
    bm.free(a)
    # b hits both cached blocks (taking them out of the free pool) and needs 2 more: only 1 left -> refuse cleanly
    b = make_request("b", prefix(64) + [7])
    assert not bm.admit(b)
    assert b.block_ids == [] and bm.num_free_blocks == 3 and bm.num_cached_blocks == 2


def test_eviction_is_lru_and_tail_first() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS)
    a = make_request("a", prefix(49, base=0))  # 4 blocks, 3 full of computed tokens
    b = make_request("b", prefix(33, base=500))  # 3 blocks, 2 full of computed tokens
    for r in (a, b):
        assert bm.admit(r)
        r.num_computed_tokens = r.num_tokens - 1
        bm.commit(r)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    assert bm.num_free_blocks == 0
    bm.free(a)  # a's partial block -> free list; full ones evictable tail first: a2, a1, a0
    bm.free(b)  # b's partial block -> free list; then b1, b0
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 5
    c = make_request("c", prefix(16 * 5, base=9000))
    assert bm.admit(c)
    # plain free blocks first, then evictions in least-recently-freed order
    assert c.block_ids == [a_blocks[3], b_blocks[2], a_blocks[2], a_blocks[1], a_blocks[0]]
    assert all(bm.block_hash(x) is None for x in c.block_ids)
    assert bm.num_cached_blocks == 2
    # b's cached prefix survived the eviction of the older-freed a
    bm.free(c)
    d = make_request("d", prefix(33, base=500))
    assert bm.admit(d)
    assert d.num_cached_tokens == 32 and d.block_ids[:2] == b_blocks[:2]


def test_lru_evicts_least_recently_freed_request_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", prefix(17, base=0))
    b = make_request("b", prefix(17, base=100))
    for r in (a, b):
        assert bm.admit(r)
        r.num_computed_tokens = 16
        bm.commit(r)
    a0, b0 = a.block_ids[0], b.block_ids[0]
    bm.free(b)  # b freed first -> evicted first
    bm.free(a)
    # 3 blocks: 2 plain free + the least recently freed cached one
    c = make_request("c", prefix(48, base=300))
    assert bm.admit(c)
    assert b0 in c.block_ids and a0 not in c.block_ids
    assert bm.block_hash(a0) is not None


def test_truncate_frees_only_tail_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", prefix(20))
    assert bm.admit(req)
    req.num_computed_tokens = 19
    assert bm.ensure_slots(req, 20 + 30)  # room for 30 drafts -> 4 blocks
    assert len(req.block_ids) == 4
    kept = req.block_ids[:2]
    bm.truncate(req, 17)  # position 16 still needs block 1
    assert req.block_ids == kept
    assert bm.num_free_blocks == 6
    bm.truncate(req, 40)  # never grows
    assert req.block_ids == kept


def test_duplicate_concurrent_prefix_is_not_double_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prefix(33))
    b = make_request("b", prefix(33))
    assert bm.admit(a) and bm.admit(b)  # both miss: nothing cached yet
    assert set(a.block_ids).isdisjoint(b.block_ids)
    compute_all(bm, a)
    compute_all(bm, b)
    assert a.block_hashes == b.block_hashes
    assert [bm.block_hash(x) for x in a.block_ids[:2]] == a.block_hashes
    assert all(bm.block_hash(x) is None for x in b.block_ids)
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2


def test_no_hashing_when_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", prefix(40))
    assert bm.admit(a)
    compute_all(bm, a)
    assert a.block_hashes == [] and bm.num_cached_blocks == 0
    bm.free(a)
    b = make_request("b", prefix(40))
    assert bm.admit(b)
    assert b.num_cached_tokens == 0 and b.block_hashes == []
    assert bm.stats.queries == 0


def test_prefix_cache_can_be_skipped_per_admission() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prefix(40))
    assert bm.admit(a)
    compute_all(bm, a)
    b = make_request("b", prefix(40))
    assert bm.admit(b, use_prefix_cache=False)
    assert b.num_cached_tokens == 0 and set(b.block_ids).isdisjoint(a.block_ids)


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prefix(40))
    assert bm.admit(a)
    compute_all(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    b = make_request("b", prefix(40))
    assert bm.admit(b)
    assert b.num_cached_tokens == 0


def test_hash_collision_is_not_a_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", prefix(33))
    assert bm.admit(a)
    compute_all(bm, a)
    b = make_request("b", prefix(33, base=7000))
    b.block_hashes = list(a.block_hashes)  # forged: same hashes, different tokens
    assert bm.admit(b)
    assert b.num_cached_tokens == 0


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)
