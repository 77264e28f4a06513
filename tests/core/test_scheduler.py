"""Scheduler: continuous batching, chunked prefill, preemption, prefix caching, drafts, aborts, and a stress test.

The driver `FakeEngine` plays the engine's part with a deterministic fake "model": the next token after `t` is
`(7 * t + 3) % 100`. It also keeps a paged fake KV store (slot -> (position, token)) and, on every forward, checks
that every position the request attends to holds exactly the token its sequence has there, and that it never writes
into a block that is shared or in the prefix cache. So a lost, stale or wrongly shared block fails the test.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter
from collections.abc import Callable

import pytest

from tandem.config import SchedulerConfig
from tandem.core.kv_blocks import ROOT_HASH, BlockManager, hash_block
from tandem.core.plan import StepPlan
from tandem.core.scheduler import KVCacheTooSmallError, Scheduler
from tandem.params import SamplingParams
from tandem.request import Request, RequestStatus


def next_token(t: int) -> int:
    return (7 * t + 3) % 100


def alone_output(prompt: list[int], max_tokens: int, stop_token: int | None = None) -> list[int]:
    """What the fake model produces for one request run by itself."""
    out: list[int] = []
    last = prompt[-1]
    while len(out) < max_tokens:
        last = next_token(last)
        out.append(last)
        if last == stop_token:
            break
    return out


Drafter = Callable[[Request], list[int]]


class FakeEngine:
    """Test driver: sets drafts, schedules, runs the fake model on the plan, updates, applies stop conditions."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int = 4096,
        prefix_caching: bool = True,
        drafter: Drafter | None = None,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.sched = Scheduler(config, self.bm)
        self.drafter = drafter
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token) written there
        self.live: dict[str, Request] = {}
        self.done: dict[str, Request] = {}
        self.stop_tokens: dict[str, int | None] = {}
        self.plans: list[StepPlan] = []

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int = 8,
        stop_token: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> Request:
        req = Request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
        )
        self.live[rid] = req
        self.stop_tokens[rid] = stop_token
        self.sched.add(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.sched.abort(rid)
        assert req is not None and req.status is RequestStatus.FINISHED_ABORTED and req.block_ids == []
        self.done[rid] = self.live.pop(rid)

    def step(self) -> StepPlan:
        if self.drafter is not None:
            for req in self.live.values():
                if req.status is RequestStatus.RUNNING and req.num_tokens - req.num_computed_tokens == 1:
                    req.draft_token_ids = self.drafter(req)
        plan = self.sched.schedule()
        check_invariants(self)
        new_tokens = self.run(plan)
        self.sched.update(plan, new_tokens)
        for sr in plan.requests:
            if sr.needs_logits and sr.request_id in self.live:
                self.apply_stop(self.live[sr.request_id])
        check_invariants(self)
        self.plans.append(plan)
        return plan

    def run_to_completion(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("requests did not finish")

    # the fake model -------------------------------------------------------------------------------------------
    def slot(self, block_table: list[int], pos: int) -> int:
        bs = self.bm.block_size
        return block_table[pos // bs] * bs + pos % bs

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for sr in plan.requests:
            req = self.live[sr.request_id]
            assert sr.block_table == req.block_ids and sr.block_table is not req.block_ids
            # attention reads every earlier position: its KV must be this sequence's token at that position
            for p in range(sr.start_pos):
                assert self.kv.get(self.slot(sr.block_table, p)) == (p, req.token_ids[p]), (sr.request_id, p)
            for j, tok in enumerate(sr.input_ids):
                pos = sr.start_pos + j
                block = sr.block_table[pos // self.bm.block_size]
                assert self.bm.ref_count(block) == 1, "writing into a shared block"
                assert self.bm.block_hash(block) is None, "writing into a cached block"
                self.kv[self.slot(sr.block_table, pos)] = (pos, tok)
            if not sr.needs_logits:
                continue
            assert sr.start_pos + sr.num_tokens - sr.num_draft_tokens == req.num_tokens
            n_real = sr.num_tokens - sr.num_draft_tokens
            predicted = next_token(sr.input_ids[n_real - 1])
            accepted: list[int] = []
            for d in sr.input_ids[n_real:]:
                if d != predicted:
                    break
                accepted.append(d)
                predicted = next_token(d)
            accepted.append(predicted)
            out[sr.request_id] = self.cut_at_stop(req, accepted)
        return out

    def cut_at_stop(self, req: Request, tokens: list[int]) -> list[int]:
        room = (req.params.max_tokens or 10**9) - req.num_output_tokens
        tokens = tokens[:room]
        stop = self.stop_tokens[req.request_id]
        if stop in tokens:
            tokens = tokens[: tokens.index(stop) + 1]
        return tokens

    def apply_stop(self, req: Request) -> None:
        if req.output_token_ids and req.output_token_ids[-1] == self.stop_tokens[req.request_id]:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= (req.params.max_tokens or 10**9):
            status = RequestStatus.FINISHED_LENGTH
        else:
            return
        self.sched.finish(req.request_id, status)
        assert req.status is status and req.block_ids == []
        self.done[req.request_id] = self.live.pop(req.request_id)


def check_invariants(eng: FakeEngine) -> None:
    """Block ownership and prefix-cache invariants over all live requests."""
    bm, sched = eng.bm, eng.sched
    bs = bm.block_size
    holders: Counter[int] = Counter()
    positions: dict[int, list[tuple[Request, int]]] = {}
    running = 0
    for req in eng.live.values():
        assert sched.get(req.request_id) is req
        if req.status is not RequestStatus.RUNNING:
            assert req.block_ids == [] and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            continue
        running += 1
        assert len(set(req.block_ids)) == len(req.block_ids)
        assert req.num_computed_tokens <= req.num_tokens
        assert len(req.block_ids) * bs >= req.num_computed_tokens
        holders.update(req.block_ids)
        for i, b in enumerate(req.block_ids):
            positions.setdefault(b, []).append((req, i))
        if bm.enable_prefix_caching:  # memoised hashes are the chained hashes of the token blocks
            parent = ROOT_HASH
            for i, h in enumerate(req.block_hashes):
                parent = hash_block(parent, req.token_ids[i * bs : (i + 1) * bs])
                assert h == parent
        else:
            assert req.block_hashes == []
    assert running == sched.num_running
    assert len(eng.live) == sched.num_running + sched.num_waiting
    for b, n in holders.items():
        assert bm.ref_count(b) == n
        if n > 1:
            # shared: only a cached block, full of computed tokens, at the same index with the same tokens
            assert bm.block_hash(b) is not None
            owners = positions[b]
            (r0, i0) = owners[0]
            for r, i in owners:
                assert i == i0 and (i + 1) * bs <= r.num_computed_tokens
                assert r.token_ids[i * bs : (i + 1) * bs] == r0.token_ids[i0 * bs : (i0 + 1) * bs]
    assert len(holders) + bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks) if b not in holders)


def ids(plan: StepPlan) -> list[str]:
    return [sr.request_id for sr in plan.requests]


def entry(plan: StepPlan, rid: str):  # noqa: ANN201 - test helper
    return next(sr for sr in plan.requests if sr.request_id == rid)


# ------------------------------------------------------------------------------------------------------ tests
def test_request_statuses_say_whether_they_ended() -> None:
    """`finished` (a plain attribute of each member) and `finish_reason`, also after a pickle round trip."""
    ended = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
             RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}
    for status in RequestStatus:
        assert status.finished is (status in ended)
        assert status.finish_reason == ended.get(status)
        assert pickle.loads(pickle.dumps(status)).finished is status.finished


def test_single_request_decodes_expected_tokens() -> None:
    eng = FakeEngine(num_blocks=16, block_size=4)
    req = eng.add("a", [5, 6, 7], max_tokens=6)
    first = eng.step()
    sr = first.requests[0]
    assert (sr.start_pos, sr.input_ids, sr.needs_logits, sr.is_prefill) == (0, [5, 6, 7], True, True)
    second = eng.step()
    assert second.requests[0].input_ids == [next_token(7)] and second.requests[0].start_pos == 3
    eng.run_to_completion()
    assert req.output_token_ids == alone_output([5, 6, 7], 6)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert eng.bm.num_free_blocks == 16 and not eng.sched.has_unfinished()


def test_stop_token_finishes_early() -> None:
    eng = FakeEngine(num_blocks=16, block_size=4)
    req = eng.add("a", [77], max_tokens=10, stop_token=42)  # next_token(77) == 42
    eng.run_to_completion()
    assert req.output_token_ids == [42] and req.status is RequestStatus.FINISHED_STOPPED


def test_continuous_batching_requests_join_and_leave() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4)
    eng.add("a", [1, 2, 3], max_tokens=2)
    eng.add("b", [4, 5], max_tokens=5)
    assert ids(eng.step()) == ["a", "b"]  # both prefill together
    eng.add("c", [9, 9, 9, 9], max_tokens=3)
    plan = eng.step()  # a, b decode while c prefills in the same step
    assert ids(plan) == ["a", "b", "c"]
    assert [sr.num_tokens for sr in plan.requests] == [1, 1, 4]
    assert "a" in eng.done  # a reached max_tokens=2 and left
    assert ids(eng.step()) == ["b", "c"]
    eng.add("d", [3], max_tokens=1)
    assert ids(eng.step()) == ["b", "c", "d"]
    eng.run_to_completion()
    for rid, prompt, n in (("a", [1, 2, 3], 2), ("b", [4, 5], 5), ("c", [9, 9, 9, 9], 3), ("d", [3], 1)):
        assert eng.done[rid].output_token_ids == alone_output(prompt, n)
    assert eng.bm.num_free_blocks == 64


def test_chunked_prefill_under_token_budget_alongside_decodes() -> None:
    eng = FakeEngine(num_blocks=128, block_size=16, max_num_batched_tokens=256)
    eng.add("d1", [1, 2], max_tokens=40)
    eng.add("d2", [3], max_tokens=40)
    eng.step()  # both prefilled, now decoding
    long_prompt = [i % 100 for i in range(1000)]
    long = eng.add("long", long_prompt, max_tokens=3)
    chunks = []
    for _ in range(4):
        plan = eng.step()
        assert ids(plan) == ["d1", "d2", "long"]
        assert [sr.num_tokens for sr in plan.requests[:2]] == [1, 1]  # decodes continue
        assert plan.num_tokens <= 256
        chunks.append(entry(plan, "long"))
    assert [c.num_tokens for c in chunks] == [254, 254, 254, 238]
    assert [c.start_pos for c in chunks] == [0, 254, 508, 762]
    assert [c.needs_logits for c in chunks] == [False, False, False, True]
    assert chunks[1].input_ids == long_prompt[254:508]
    assert long.num_output_tokens == 1
    eng.run_to_completion()
    assert long.output_token_ids == alone_output(long_prompt, 3)
    assert eng.done["d1"].output_token_ids == alone_output([1, 2], 40)
    assert eng.bm.num_free_blocks == 128


def test_long_prompt_alone_takes_four_steps() -> None:
    eng = FakeEngine(num_blocks=128, block_size=16, max_num_batched_tokens=256)
    eng.add("long", list(range(1000)), max_tokens=1)
    plans = [eng.step() for _ in range(4)]
    assert [p.requests[0].num_tokens for p in plans] == [256, 256, 256, 232]
    assert "long" in eng.done


def test_max_num_seqs_limits_running() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2)
    for i in range(4):
        eng.add(f"r{i}", [i + 1, i + 2], max_tokens=3)
    plan = eng.step()
    assert ids(plan) == ["r0", "r1"]
    assert eng.sched.num_running == 2 and eng.sched.num_waiting == 2
    while eng.sched.has_unfinished():
        plan = eng.step()
        assert len(plan.requests) <= 2 and eng.sched.num_running <= 2
    for i in range(4):
        assert eng.done[f"r{i}"].output_token_ids == alone_output([i + 1, i + 2], 3)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_resumes_and_completes(prefix_caching: bool) -> None:
    # 10 blocks of 4 = 40 positions; each request grows to 12 + 20 = 32 positions: both cannot stay resident
    eng = FakeEngine(num_blocks=10, block_size=4, prefix_caching=prefix_caching)
    a = eng.add("a", list(range(10, 22)), max_tokens=20)
    b = eng.add("b", list(range(50, 62)), max_tokens=20)
    preempted_plan = None
    resumed = None
    while eng.sched.has_unfinished():
        plan = eng.step()
        if plan.preempted_ids and preempted_plan is None:
            preempted_plan = plan
            assert plan.preempted_ids == ["b"]  # the most recently admitted goes
            assert "b" not in ids(plan)  # and is not re-admitted in the same step
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
            assert eng.sched.num_waiting == 1
            tokens_at_preemption = list(b.token_ids)
        elif preempted_plan is not None and resumed is None and "b" in ids(plan):
            resumed = entry(plan, "b")
    assert preempted_plan is not None and resumed is not None
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # recompute covers prompt + outputs so far (minus what the prefix cache still held)
    assert resumed.input_ids == tokens_at_preemption[resumed.start_pos :]
    assert resumed.start_pos % 4 == 0 and resumed.needs_logits
    if not prefix_caching:
        assert resumed.start_pos == 0
    assert a.output_token_ids == alone_output(list(range(10, 22)), 20)
    assert b.output_token_ids == alone_output(list(range(50, 62)), 20)
    assert eng.bm.num_free_blocks == 10


def test_preempted_request_resumes_before_later_arrivals() -> None:
    eng = FakeEngine(num_blocks=10, block_size=4, max_num_seqs=2, prefix_caching=False)
    eng.add("a", list(range(10, 22)), max_tokens=20)
    b = eng.add("b", list(range(50, 62)), max_tokens=20)
    eng.add("c", [1], max_tokens=1)  # waits behind a and b (max_num_seqs=2)
    first_seen: dict[str, tuple[int, int]] = {}  # id -> (step, place in the plan)
    while eng.sched.has_unfinished():
        plan = eng.step()
        if plan.preempted_ids:
            first_seen.pop("b", None)  # count b's first scheduling after the preemption
        for place, rid in enumerate(ids(plan)):
            first_seen.setdefault(rid, (plan.step_id, place))
    assert b.num_preemptions == 1
    assert first_seen["b"] < first_seen["c"]  # preempted requests go to the front of the queue
    assert eng.done["c"].output_token_ids == alone_output([1], 1)


def test_preemption_uses_prefix_cache_on_resume() -> None:
    eng = FakeEngine(num_blocks=10, block_size=4, prefix_caching=True)
    eng.add("a", list(range(10, 22)), max_tokens=20)
    b = eng.add("b", list(range(50, 62)), max_tokens=20)
    while not b.num_preemptions:
        eng.step()
    # b's full blocks went to the evictable cache; on resume it gets whatever was not evicted meanwhile
    while b.status is not RequestStatus.RUNNING:
        eng.step()
    assert b.num_cached_tokens > 0
    eng.run_to_completion()
    assert b.output_token_ids == alone_output(list(range(50, 62)), 20)
    assert eng.bm.stats.hits >= b.num_cached_tokens


def test_request_larger_than_cache_raises_clearly() -> None:
    eng = FakeEngine(num_blocks=2, block_size=4)
    eng.add("big", list(range(12)), max_tokens=1)
    with pytest.raises(KVCacheTooSmallError, match="num_blocks=2 x block_size=4") as err:
        eng.step()
    assert err.value.request_id == "big"


def test_request_outgrowing_cache_while_decoding_raises() -> None:
    eng = FakeEngine(num_blocks=2, block_size=4)
    eng.add("grow", [1, 2, 3, 4, 5, 6], max_tokens=10)
    with pytest.raises(KVCacheTooSmallError, match="num_blocks=2"):
        eng.run_to_completion()


def test_prefix_cache_shares_64_token_prefix() -> None:
    eng = FakeEngine(num_blocks=64, block_size=16)
    shared = [(i * 13) % 100 for i in range(64)]
    a = eng.add("a", shared + [1, 2, 3], max_tokens=5)
    eng.step()  # a's prompt computed: its 4 full blocks are committed to the cache
    b = eng.add("b", shared + [7, 8], max_tokens=5)
    plan = eng.step()
    sb = entry(plan, "b")
    assert b.num_cached_tokens == 64 and sb.start_pos == 64 and sb.input_ids == [7, 8]
    assert sb.block_table[:4] == a.block_ids[:4]
    assert all(eng.bm.ref_count(x) == 2 for x in a.block_ids[:4])
    assert eng.bm.stats.hits == 64
    eng.run_to_completion()
    assert a.output_token_ids == alone_output(shared + [1, 2, 3], 5)
    assert b.output_token_ids == alone_output(shared + [7, 8], 5)
    assert eng.bm.num_free_blocks == 64


def test_fully_cached_prompt_computes_its_last_token() -> None:
    eng = FakeEngine(num_blocks=64, block_size=16)
    prompt = [(i * 3) % 100 for i in range(64)]
    eng.add("a", prompt, max_tokens=1)
    eng.run_to_completion()
    b = eng.add("b", prompt, max_tokens=2)
    sb = eng.step().requests[0]
    assert b.num_cached_tokens == 48  # never the whole prompt
    assert sb.start_pos == 48 and sb.input_ids == prompt[48:] and sb.needs_logits
    eng.run_to_completion()
    assert b.output_token_ids == alone_output(prompt, 2)


def test_prompt_logprobs_get_all_logits_and_skip_the_cache() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = list(range(20, 32))
    eng.add("a", prompt, max_tokens=1)
    eng.run_to_completion()
    b = eng.add("b", prompt, max_tokens=3, prompt_logprobs=1)
    first = eng.step().requests[0]
    assert b.num_cached_tokens == 0 and first.start_pos == 0
    assert first.all_logits and not first.needs_logits and first.num_tokens == 8
    assert first.num_logits_rows == 8  # prompt-logprob rows for every chunk
    last_chunk = eng.step().requests[0]
    assert last_chunk.all_logits and last_chunk.needs_logits and last_chunk.num_logits_rows == 4
    decode = eng.step().requests[0]
    assert not decode.all_logits and decode.num_logits_rows == 1
    eng.run_to_completion()
    assert b.output_token_ids == alone_output(prompt, 3)


def test_drafts_consume_budget_and_blocks_and_rollback_frees_blocks() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4)
    req = eng.add("a", [1, 2, 3], max_tokens=50)
    eng.step()  # prefill: 3 computed, 1 sampled -> num_tokens 4, 1 block
    assert req.num_computed_tokens == 3 and req.num_tokens == 4 and len(req.block_ids) == 1
    last = req.token_ids[-1]
    good1 = next_token(last)
    good2 = next_token(good1)
    req.draft_token_ids = [good1, good2, 99, 98, 97, 96]  # 2 right, then wrong
    free_before = eng.bm.num_free_blocks
    plan = eng.sched.schedule()
    sr = plan.requests[0]
    assert sr.num_draft_tokens == 6 and sr.input_ids == [last, good1, good2, 99, 98, 97, 96]
    assert plan.num_tokens == 7 and sr.num_logits_rows == 7 and not sr.is_prefill
    assert len(req.block_ids) == 3  # positions [0, 3 + 7) -> 3 blocks
    assert eng.bm.num_free_blocks == free_before - 2
    new = eng.run(plan)
    assert new["a"] == [good1, good2, next_token(good2)]
    eng.sched.update(plan, new)
    assert req.num_computed_tokens == 3 + 1 + 2 and req.num_tokens == 7
    assert req.draft_token_ids == []
    assert len(req.block_ids) == 2  # rejected drafts' block released
    assert eng.bm.num_free_blocks == free_before - 1
    check_invariants(eng)
    eng.run_to_completion()
    assert req.output_token_ids == alone_output([1, 2, 3], 50)


def test_drafts_only_at_steady_decode() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    req = eng.add("a", list(range(10)), max_tokens=5)
    eng.step()  # chunk of 4: still prefilling
    req.draft_token_ids = [1, 2, 3]
    sr = eng.sched.schedule().requests[0]
    assert sr.num_draft_tokens == 0 and sr.input_ids == list(range(4, 8)) and req.draft_token_ids == []


def test_drafts_cut_to_budget_never_split() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=3)
    req = eng.add("a", [1, 2], max_tokens=20)
    eng.step()
    req.draft_token_ids = [10, 11, 12, 13, 14]
    plan = eng.sched.schedule()
    sr = plan.requests[0]
    assert sr.num_draft_tokens == 2 and sr.input_ids[1:] == [10, 11] and req.draft_token_ids == [10, 11]
    new = eng.run(plan)
    eng.sched.update(plan, new)
    assert req.draft_token_ids == []  # the cut drafts are not carried to the next step


def test_drafts_cut_to_max_model_len() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4, max_model_len=6)
    req = eng.add("a", [1, 2, 3], max_tokens=3)
    eng.step()  # num_tokens 4: drafts may occupy positions 4 and 5 only
    req.draft_token_ids = [7, 7, 7, 7]
    assert eng.sched.schedule().requests[0].num_draft_tokens == 2


def test_drafts_dropped_before_anyone_is_preempted() -> None:
    eng = FakeEngine(num_blocks=4, block_size=4)
    a = eng.add("a", [1, 2, 3], max_tokens=5)
    b = eng.add("b", [4, 5, 6, 7, 8, 9, 10, 11, 12], max_tokens=3)
    eng.step()  # a: 1 block, b: 3 blocks (positions 0..9) -> pool full
    assert eng.bm.num_free_blocks == 0
    a.draft_token_ids = [1, 2, 3, 4, 5]  # would need a second block for a
    plan = eng.sched.schedule()
    assert plan.preempted_ids == [] and entry(plan, "a").num_draft_tokens == 0
    assert a.draft_token_ids == []
    eng.sched.update(plan, eng.run(plan))
    assert b.num_preemptions == 0


def test_update_rejects_inconsistent_tokens() -> None:
    eng = FakeEngine(num_blocks=32, block_size=4)
    req = eng.add("a", [1, 2], max_tokens=20)
    eng.step()
    req.draft_token_ids = [5, 6]
    plan = eng.sched.schedule()
    with pytest.raises(ValueError, match="expected 1..3"):
        eng.sched.update(plan, {"a": [5, 6, 7, 8]})
    with pytest.raises(ValueError, match="not a prefix of the drafts"):
        eng.sched.update(plan, {"a": [6, 1]})


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_seqs=1)
    a = eng.add("a", list(range(9)), max_tokens=10)
    eng.add("b", [1, 2], max_tokens=10)
    eng.step()
    assert a.status is RequestStatus.RUNNING and eng.bm.num_free_blocks < 16
    eng.abort("b")  # waiting
    assert eng.sched.num_waiting == 0
    eng.abort("a")  # running
    assert eng.bm.num_free_blocks == 16 and not eng.sched.has_unfinished()
    assert eng.sched.abort("a") is None and eng.sched.abort("nope") is None


def test_abort_between_schedule_and_update_is_skipped() -> None:
    eng = FakeEngine(num_blocks=16, block_size=4)
    a = eng.add("a", [1, 2, 3], max_tokens=5)
    b = eng.add("b", [4, 5, 6], max_tokens=5)
    plan = eng.sched.schedule()
    new = eng.run(plan)
    eng.abort("a")
    eng.sched.update(plan, new)
    assert a.num_computed_tokens == 0 and a.output_token_ids == [] and a.block_ids == []
    assert b.num_computed_tokens == 3 and b.num_output_tokens == 1
    eng.run_to_completion()
    assert eng.bm.num_free_blocks == 16


def _two_scheduled_ahead() -> tuple[Scheduler, Request, Request, StepPlan, StepPlan]:
    """Requests a [1, 2, 3] and b [4, 5, 6] (blocks of 2, prefix caching), their prompts' plan and the next one
    scheduled ahead of its outcome, both reserved."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      BlockManager(16, 2, enable_prefix_caching=True))
    a, b = Request("a", [1, 2, 3], SamplingParams(max_tokens=8)), Request("b", [4, 5, 6], SamplingParams(max_tokens=8))
    sched.add(a)
    sched.add(b)
    cur = sched.schedule()
    sched.reserve(cur)
    nxt = sched.schedule(frozenset({"a", "b"}))
    sched.reserve(nxt)
    return sched, a, b, cur, nxt


def test_withdraw_takes_a_request_out_of_a_plan_scheduled_ahead() -> None:
    """Scheduling ahead, a request whose sampled token comes late sits out the next plan: `withdraw` undoes its
    reservation, the late token resolves its placeholder, and the plan after feeds it; no placeholder reaches the
    prefix cache."""
    from tandem.core.scheduler import PLACEHOLDER

    sched, a, b, cur, nxt = _two_scheduled_ahead()
    assert a.token_ids == [1, 2, 3, PLACEHOLDER, PLACEHOLDER] and a.num_computed_tokens == 4
    sched.withdraw(nxt, ["a"])
    assert [sr.request_id for sr in nxt.requests] == ["b"]
    assert a.token_ids == [1, 2, 3, PLACEHOLDER] and a.num_computed_tokens == 3
    sched.resolve(cur, {"b": [7]}, nxt)
    assert nxt.requests[0].input_ids == [7] and a.token_ids[-1] == PLACEHOLDER
    sched.resolve(StepPlan(cur.step_id, [sr for sr in cur.requests if sr.request_id == "a"]), {"a": [9]}, None)
    assert a.token_ids == [1, 2, 3, 9]
    after = sched.schedule(frozenset({"b"}))
    assert [(sr.request_id, sr.input_ids, sr.start_pos) for sr in after.requests] == [("a", [9], 3), ("b", [PLACEHOLDER], 4)]
    sched.reserve(after)
    sched.resolve(nxt, {"b": [8]}, after)
    sched.resolve(after, {"a": [5], "b": [6]}, None)
    first = hash_block(ROOT_HASH, [1, 2])
    assert a.block_hashes == [first, hash_block(first, [3, 9])]  # the late token, never the placeholder


def test_retract_throws_away_the_row_fed_a_wrong_token_and_feeds_the_position_again() -> None:
    """Scheduling ahead, the next plan was launched fed an unchecked token the grammar then rejected: `retract`
    replaces it, the request's row in that plan becomes garbage (its position counts as not computed, the
    placeholder it samples into is dropped), and the plan after feeds the position again with
    the right token; the prefix cache never learns the wrong one. A request whose row of the plan does not compute
    that position only has its token replaced."""
    from tandem.core.scheduler import PLACEHOLDER

    sched, a, b, cur, nxt = _two_scheduled_ahead()
    # a's 7 goes out unchecked, in nxt's inputs; the prefix cache is offered blocks only after the checks (commit)
    sched.resolve(cur, {"a": [7], "b": [8]}, nxt, commit=False)
    assert a.token_ids == [1, 2, 3, 7, PLACEHOLDER] and a.num_computed_tokens == 4 and len(a.block_ids) == 2
    assert sched.retract(nxt, "a", 3, 9)
    assert a.token_ids == [1, 2, 3, 9] and a.num_computed_tokens == 3 and a.num_tentative == 0
    assert len(a.block_ids) == 2  # position 3's block kept: the plan after writes it again
    sched.commit(cur)
    after = sched.schedule(frozenset({"a", "b"}))
    assert [(sr.request_id, sr.input_ids, sr.start_pos) for sr in after.requests] == [("a", [9], 3), ("b", [PLACEHOLDER], 4)]
    sched.reserve(after)
    sched.resolve(nxt, {"b": [5]}, after)  # a's row of nxt (garbage) is thrown away: no token from it
    sched.resolve(after, {"a": [6], "b": [6]}, None)
    first = hash_block(ROOT_HASH, [1, 2])
    assert a.token_ids == [1, 2, 3, 9, 6] and a.block_hashes == [first, hash_block(first, [3, 9])]
    assert not sched.retract(after, "b", 3, 2)  # b's row of `after` computes position 4, not 3: kept
    assert b.token_ids[3] == 2 and b.num_computed_tokens == 5


def test_feed_before_the_launch_then_resolve_is_resolve_with_the_next_plan() -> None:
    """The engine feeds the sampled tokens into the next plan before launching it and resolves the requests after:
    the same inputs and token lists as one `resolve` with the next plan; a withdrawn or unsampled request keeps its
    placeholder, and a row that does not reach it (a chunk) is untouched."""
    from tandem.core.scheduler import PLACEHOLDER

    def run(split: bool) -> tuple[list[tuple[str, list[int]]], list[list[int]]]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                          BlockManager(32, 2, enable_prefix_caching=True))
        reqs = [Request(r, [1, 2, 3 + i], SamplingParams(max_tokens=8)) for i, r in enumerate("abc")]
        for r in reqs:
            sched.add(r)
        cur = sched.schedule()
        sched.reserve(cur)
        nxt = sched.schedule(frozenset("abc"))
        sched.reserve(nxt)
        sched.withdraw(nxt, ["c"])
        tokens = {"a": [7], "b": [], "c": [9]}  # b got no token (unsettled), c was withdrawn
        if split:
            sched.feed(tokens, nxt)
            sched.resolve(cur, tokens, None)
        else:
            sched.resolve(cur, tokens, nxt)
        return [(sr.request_id, list(sr.input_ids)) for sr in nxt.requests], [list(r.token_ids) for r in reqs]

    assert run(split=True) == run(split=False)
    inputs, ids = run(split=True)
    assert inputs == [("a", [7]), ("b", [PLACEHOLDER])] and ids[0][-2:] == [7, PLACEHOLDER]


def test_finish_and_add_validation() -> None:
    eng = FakeEngine(num_blocks=16, block_size=4)
    eng.add("a", [1], max_tokens=5)
    with pytest.raises(ValueError, match="already scheduled"):
        eng.sched.add(Request("a", [2], SamplingParams()))
    with pytest.raises(ValueError, match="finished status"):
        eng.sched.finish("a", RequestStatus.RUNNING)
    with pytest.raises(KeyError):
        eng.sched.finish("zzz", RequestStatus.FINISHED_STOPPED)


# ------------------------------------------------------------------------------------------------ stress test
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(seed: int, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    block_size, num_blocks = 4, 24  # 96 positions shared by up to 6 requests

    def drafter(req: Request) -> list[int]:
        drafts, t = [], req.token_ids[-1]
        for _ in range(rng.randint(0, 4)):
            t = next_token(t) if rng.random() < 0.6 else rng.randrange(100)
            drafts.append(t)
        return drafts

    eng = FakeEngine(
        num_blocks,
        block_size,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=num_blocks * block_size,
        prefix_caching=prefix_caching,
        drafter=drafter,
    )
    prefixes = [[rng.randrange(100) for _ in range(n)] for n in (0, 8, 12, 16)]
    specs: dict[str, tuple[list[int], int, int | None]] = {}
    aborted: set[str] = set()
    pending = 40
    steps = 0
    while pending or eng.sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if not pending:
                break
            pending -= 1
            rid = f"r{pending}"
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(1, 96 - len(prompt) if rng.random() < 0.2 else 25)
            stop = rng.choice([None, None, 42])
            specs[rid] = (prompt, max_tokens, stop)
            eng.add(rid, prompt, max_tokens=max_tokens, stop_token=stop)
        if eng.live and rng.random() < 0.03:
            rid = rng.choice(sorted(eng.live))
            eng.abort(rid)
            aborted.add(rid)
        eng.step()
        steps += 1
        assert steps < 5000
    assert eng.bm.num_free_blocks == num_blocks
    assert sum(r.num_preemptions for r in eng.done.values()) > 0  # the pool really was too small
    if prefix_caching:
        assert eng.bm.stats.hits > 0
    assert len(eng.done) == 40
    for rid, req in eng.done.items():
        prompt, max_tokens, stop = specs[rid]
        expected = alone_output(prompt, max_tokens, stop)
        if rid in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            assert req.output_token_ids == expected[: req.num_output_tokens]
        else:
            assert req.output_token_ids == expected, rid
            assert req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


# ------------------------------------------------------------------------------ scheduling ahead with drafts
def _ahead_pair(drafts_cur: list[int], drafts_nxt: list[int], block_size: int = 4):  # type: ignore[no-untyped-def]
    """One request in steady decode: `cur` verifies `drafts_cur` (reserved), `nxt` is scheduled past it with
    `drafts_nxt` (reserved, not launched)."""
    bm = BlockManager(32, block_size, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    req = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=32))
    sched.add(req)
    sched.reserve(pre := sched.schedule())  # the prefill, sampled 9
    sched.settle(pre, {"a": [9]}, StepPlan(99), [])
    sched.confirm()  # after the launch: the requests learn the fed tokens
    req.draft_token_ids = list(drafts_cur)
    cur = sched.schedule()
    sched.reserve(cur)
    req.draft_token_ids = list(drafts_nxt)
    nxt = sched.schedule(frozenset({"a"}))
    sched.reserve(nxt)
    return sched, bm, req, cur, nxt


def test_reserve_takes_drafts_as_accepted_and_counts_the_tentative_tail() -> None:
    from tandem.core.scheduler import PLACEHOLDER

    _, _, req, cur, nxt = _ahead_pair([20, 21], [30, 31, 32])
    assert cur.requests[0].input_ids == [9, 20, 21] and cur.requests[0].start_pos == 7
    assert nxt.requests[0].input_ids == [PLACEHOLDER, 30, 31, 32] and nxt.requests[0].start_pos == 10
    assert req.token_ids == [1, 2, 3, 4, 5, 6, 7, 9, 20, 21, PLACEHOLDER, 30, 31, 32, PLACEHOLDER]
    assert req.num_tentative == 2 + 1 + 3 + 1 and req.num_computed_tokens == 14
    assert req.confirmed_output_ids == [9] and list(req.confirmed_tokens) == [1, 2, 3, 4, 5, 6, 7, 9]


def test_settle_keeps_the_next_row_when_every_draft_was_accepted_as_assumed() -> None:
    from tandem.core.scheduler import PLACEHOLDER

    sched, _, req, cur, nxt = _ahead_pair([20, 21], [30, 31])
    assert sched.settle(cur, {"a": [20, 21, 22]}, nxt, ["a"]) == []
    sched.confirm()  # after the launch: the requests learn the fed tokens
    assert nxt.requests[0].input_ids == [22, 30, 31] and nxt.requests[0].start_pos == 10
    assert req.token_ids[-4:] == [22, 30, 31, PLACEHOLDER] and req.num_tentative == 3
    assert req.confirmed_output_ids == [9, 20, 21, 22]


def test_settle_feeds_the_next_row_and_confirm_tells_the_request() -> None:
    """Before the launch `settle` writes a kept row's token into the next plan only; the request learns it in
    `confirm` (for some requests, e.g. before a redraft, or all), once."""
    from tandem.core.scheduler import PLACEHOLDER

    sched, _, req, cur, nxt = _ahead_pair([20, 21], [30, 31])
    before = list(req.token_ids)
    assert sched.settle(cur, {"a": [20, 21, 22]}, nxt, ["a"]) == []
    assert nxt.requests[0].input_ids == [22, 30, 31]
    assert req.token_ids == before and req.token_ids[10] == PLACEHOLDER and req.num_tentative == 6
    sched.confirm(["b"])  # another request: nothing
    assert req.token_ids == before
    sched.confirm(["a"])
    assert req.token_ids[10] == 22 and req.num_tentative == 3 and req.confirmed_output_ids == [9, 20, 21, 22]
    sched.confirm()  # learned once
    assert req.num_tentative == 3


def test_settle_drops_drafts_that_assumed_another_bonus_token() -> None:
    from tandem.core.scheduler import PLACEHOLDER

    sched, bm, req, cur, nxt = _ahead_pair([20, 21], [30, 31, 32, 33, 34, 35])
    free = bm.num_free_blocks
    assert sched.settle(cur, {"a": [20, 21, 23]}, nxt, []) == ["a"]
    sched.confirm()  # after the launch: the requests learn the fed tokens
    row = nxt.requests[0]
    assert (row.input_ids, row.start_pos, row.num_draft_tokens) == ([23], 10, 0)
    assert req.token_ids[7:] == [9, 20, 21, 23, PLACEHOLDER] and req.num_tentative == 1
    assert req.num_computed_tokens == 11 and bm.num_free_blocks > free  # the drafts' blocks came back
    assert len(row.block_table) == len(req.block_ids)


def test_settle_reshapes_the_next_rows_and_confirm_settles_their_requests() -> None:
    """Before the launch `settle` changes only the next plan's rows (what the launch reads); a request whose row
    moved back or lost its drafts learns its outcome, and gives back the blocks of its rejected drafts, in
    `confirm`: after the launch, or for some requests before a redraft reads them."""
    from tandem.core.scheduler import PLACEHOLDER

    for tokens, dropped_row in (([20, 25], ([25], 9)), ([20, 21, 22, 23], ([23], 11))):
        sched, bm, req, cur, nxt = _ahead_pair([20, 21, 22], [30, 31, 32, 33, 34, 35])
        before, computed, free = list(req.token_ids), req.num_computed_tokens, bm.num_free_blocks
        assert sched.settle(cur, {"a": tokens}, nxt, []) == ["a"]
        row = nxt.requests[0]
        assert (row.input_ids, row.start_pos, row.num_draft_tokens) == (*dropped_row, 0)
        assert (req.token_ids, req.num_computed_tokens, bm.num_free_blocks) == (before, computed, free)
        sched.confirm(["b"])  # another request: nothing
        assert req.token_ids == before
        sched.confirm(["a"])
        assert req.token_ids[7:] == [9, *tokens, PLACEHOLDER] and req.num_tentative == 1
        assert req.num_computed_tokens == row.start_pos + 1 and bm.num_free_blocks > free
        assert len(row.block_table) == len(req.block_ids)
        sched.confirm()  # learned once
        assert req.token_ids[7:] == [9, *tokens, PLACEHOLDER]


def test_settle_moves_the_next_row_back_after_a_rejected_draft() -> None:
    from tandem.core.scheduler import PLACEHOLDER

    sched, _, req, cur, nxt = _ahead_pair([20, 21, 22], [30, 31])
    assert sched.settle(cur, {"a": [20, 25]}, nxt, ["a"]) == ["a"]  # draft 21 rejected, 25 sampled instead
    sched.confirm()  # after the launch: the requests learn the fed tokens
    row = nxt.requests[0]
    assert (row.input_ids, row.start_pos, row.num_draft_tokens) == ([25], 9, 0)
    assert req.token_ids[7:] == [9, 20, 25, PLACEHOLDER] and req.num_tentative == 1 and req.num_computed_tokens == 10
    # the next plan's outcome resolves as a plain row; nothing tentative is left
    sched.settle(nxt, {"a": [26]}, StepPlan(7), [])
    sched.confirm()  # after the launch: the requests learn the fed tokens
    assert req.token_ids[7:] == [9, 20, 25, 26] and req.num_tentative == 0 and req.num_computed_tokens == 10


def _three_ahead():  # type: ignore[no-untyped-def]
    """Three requests prefilling: `cur` reserved, `nxt` scheduled past it (reserved, not launched)."""
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    for rid in "abc":
        sched.add(Request(rid, [1, 2, 3], SamplingParams(max_tokens=32)))
    sched.reserve(cur := sched.schedule())
    sched.reserve(nxt := sched.schedule(frozenset("abc")))
    return sched, cur, nxt


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2]])
def test_settle_finds_each_next_row_in_step_or_out_of_it(order: list[int]) -> None:
    """`settle` walks the next plan's rows in step with the running plan's (both in admission order) and looks a
    row out of step up: each next row is fed its own request's token, logged under its index there."""
    sched, cur, nxt = _three_ahead()
    nxt.requests = [nxt.requests[k] for k in order]  # (a row left out stands for one the walk cannot find)
    tokens = {"a": [10], "b": [11], "c": [12]}
    assert sched.settle(cur, tokens, nxt, set("abc")) == []
    assert [r.input_ids[0] for r in nxt.requests] == [10 + k for k in order]
    assert sorted(nxt.edits.fed) == [(i, 0, 10 + k) for i, k in enumerate(order)]


def test_settle_walks_the_pairs_taken_while_the_plan_ran_unless_rows_were_withdrawn_since() -> None:
    """The engine pairs the running plan's rows with the next plan's while the forward runs (`pair_rows`); `settle`
    walks those pairs, and pairs again when rows were withdrawn from the next plan since (their indices moved)."""
    from tandem.core.scheduler import pair_rows

    sched, cur, nxt = _three_ahead()
    pairs = pair_rows(cur, nxt)
    assert [(rid, every, i) for rid, _, every, i, *_ in pairs] == [("a", 1, 0), ("b", 1, 1), ("c", 1, 2)]
    sched.withdraw(nxt, ["a"])  # its token came too late: b and c move up a row
    assert sched.settle(cur, {"b": [11], "c": [12]}, nxt, set("abc"), pairs) == []
    assert [r.input_ids[0] for r in nxt.requests] == [11, 12] and sorted(nxt.edits.fed) == [(0, 0, 11), (1, 0, 12)]


def test_rewrite_after_a_settled_step_throws_the_row_in_flight_away_and_feeds_the_position_again() -> None:
    """Scheduling ahead, a step settled with every draft accepted and the next row (drafts and all) launched; the
    drafts' grammar check after the launch rejects the second emitted token: `rewrite` puts the masked
    verification's token there, the row in flight is garbage, everything from that position counts as not
    computed and the blocks past the tokens come back; the plan after feeds the position again, and the prefix cache
    never learns the wrong tokens."""
    from tandem.core.scheduler import PLACEHOLDER

    sched, bm, req, cur, nxt = _ahead_pair([20, 21], [30, 31, 32, 33, 34, 35])
    sched.settle(cur, {"a": [20, 21, 22]}, nxt, ["a"])  # emitted 20, 21, 22 at positions 8, 9, 10
    sched.confirm()  # after the launch: the requests learn the fed tokens
    assert req.token_ids[7:] == [9, 20, 21, 22, 30, 31, 32, 33, 34, 35, PLACEHOLDER]
    free = bm.num_free_blocks
    assert sched.rewrite(nxt, "a", 9, [25])  # 21 rejected: the masked verification emitted 20, 25
    assert req.token_ids[7:] == [9, 20, 25] and req.num_computed_tokens == 9 and req.num_tentative == 0
    assert bm.num_free_blocks > free and len(req.block_ids) == 3  # positions 0-11 kept, nxt's drafts' blocks back
    sched.commit(cur)
    after = sched.schedule(frozenset({"a"}))
    assert [(sr.input_ids, sr.start_pos) for sr in after.requests] == [([25], 9)]
    sched.reserve(after)
    sched.settle(nxt, {}, after, [])  # the garbage row of nxt gives no tokens
    sched.confirm()  # after the launch: the requests learn the fed tokens
    sched.settle(after, {"a": [26]}, StepPlan(9), [])
    sched.confirm()  # after the launch: the requests learn the fed tokens
    sched.commit(after)
    assert req.token_ids[7:] == [9, 20, 25, 26] and req.num_computed_tokens == 10
    first = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert req.block_hashes == [first, hash_block(first, [5, 6, 7, 9])]
    assert not sched.rewrite(after, "a", 12, [1])  # past the request's tokens: nothing to rewrite


def test_add_drafts_after_a_miss_and_withdraw_undo_the_reservation() -> None:
    from tandem.core.scheduler import PLACEHOLDER

    sched, _, req, cur, nxt = _ahead_pair([20], [30])
    sched.settle(cur, {"a": [21]}, nxt, [])  # rejected at once: the row moved back to 21 alone
    sched.confirm()  # after the launch: the requests learn the fed tokens
    assert sched.add_drafts(nxt, {"a": [40, 41, 42]}) == 3
    row = nxt.requests[0]
    assert (row.input_ids, row.num_draft_tokens) == ([21, 40, 41, 42], 3)
    assert req.token_ids[7:] == [9, 21, 40, 41, 42, PLACEHOLDER] and req.num_tentative == 4
    assert len(row.block_table) * 4 >= row.start_pos + row.num_tokens  # blocks for every position it writes
    sched.withdraw(nxt, ["a"])
    assert nxt.requests == [] and req.token_ids[7:] == [9, 21] and req.num_tentative == 0
    assert req.num_computed_tokens == 8


def test_commit_never_hashes_a_tentative_draft() -> None:
    """Blocks full of reserved drafts are not offered to the prefix cache until the drafts are known."""
    sched, bm, req, cur, nxt = _ahead_pair([20, 21, 22, 23, 24, 25], [], block_size=4)
    sched.commit(cur)
    assert len(req.block_hashes) == 2  # positions 0..7 (prompt + 9): two full blocks; the drafts' ones wait
    sched.settle(cur, {"a": [20, 21, 22, 23, 24, 25, 26]}, nxt, [])
    sched.confirm()  # after the launch: the requests learn the fed tokens
    sched.commit(cur)
    assert len(req.block_hashes) == 3  # now positions 8..11 hold known tokens
