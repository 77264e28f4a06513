"""A runner's launch inputs read and built ahead (runner/launch_inputs.py): after the scheduler fed tokens, the inputs
built ahead with the fed ids put in equal the inputs built at the launch; a reshaped plan has its read patched (the op
library's `plan_patch`) and its inputs built again."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.plan_arrays import _Read, plan_rows
from tandem.layers.attention import DECODE_MAX_QUERY
from tandem.runner.launch_inputs import StepInputs
from tandem.runner.simulated import CudaLaunchInputs


def _plan(rng: random.Random, rows: int, q: int) -> StepPlan:
    """Decode (q = 1) or verify rows (q - 1 drafts each), 16-token blocks."""
    plan = StepPlan(0)
    for i in range(rows):
        start = rng.randint(1, 300)
        blocks = list(range(i * 40, i * 40 + -(-(start + q) // 16)))
        plan.requests.append(ScheduledRequest(f"r{i}", [-1] + [rng.randrange(1000) for _ in range(q - 1)], start,
                                              blocks, q - 1))
    return plan


def _tensors(inputs: StepInputs) -> list[torch.Tensor]:
    """Every tensor of `inputs`, in a fixed order."""
    if inputs.graph is not None:
        g = inputs.graph
        return [g.input_ids, g.positions, g.slots, g.num_blocks, g.block_tables, g.query_pos]
    assert inputs.eager is not None
    ids, meta, wanted = inputs.eager
    d = meta.decode
    assert d is not None and d.paged is not None
    return [ids, wanted, meta.positions, meta.slot_mapping, d.token_index, d.flat_index, d.out_rows, d.query_pos,
            d.seq_info, d.block_tables, d.paged.num_blocks, d.paged.block_tables, d.paged.query_pos]


@pytest.mark.parametrize(("rows", "q"), [(3, 1), (300, 1), (40, 3), (300, 3)])
def test_inputs_built_ahead_then_fed_equal_the_inputs_built_at_the_launch(rows: int, q: int) -> None:
    """Graph steps (decode, verify) and eager ones (300 rows: past the graphs' buckets), fed between the read and
    the launch as `Scheduler.feed` / `settle` feed (logged in `plan.edits`)."""
    plan = _plan(random.Random(rows * q), rows, q)
    inputs = CudaLaunchInputs(16, 4096, 4096)
    inputs.prepare(plan)
    assert inputs.ahead._ahead is not None and inputs.ahead._ahead.built is not None  # built while "the forward ran"
    for i, r in enumerate(plan.requests):
        r.input_ids[0] = 7 + len(r.request_id)
        plan.edits.fed.append((i, 0, r.input_ids[0]))
    rows_now, got = inputs(plan)
    want = inputs.build(plan, plan_rows(plan.requests, 16))
    assert (got.graph is None) == (want.graph is None) == (rows == 300)
    for a, b in zip(_tensors(got), _tensors(want), strict=True):
        assert torch.equal(a, b)
    assert np.array_equal(rows_now.input_ids, plan_rows(plan.requests, 16).input_ids)


@pytest.mark.raw_inputs_ahead  # (outcomes given by hand: no `settle` follows the launch)
@pytest.mark.parametrize(("rows", "q"), [(3, 1), (40, 3), (300, 1)])
def test_an_outcome_that_only_feeds_takes_the_inputs_built_ahead(rows: int, q: int) -> None:
    """A plan launched before `settle` with an outcome that only feeds tokens (`PlanEdits.outcome` without reshaped
    rows: every draft accepted and kept, or none drafted) takes the inputs built while the forward before it ran,
    the fed ids put in: the same inputs as those built at the launch for the rows `settle` then makes; an outcome
    that reshapes a row goes through the patch."""
    plan = _plan(random.Random(rows + q), rows, q)
    inputs = CudaLaunchInputs(16, 4096, 4096)
    inputs.prepare(plan)
    held = inputs.ahead._ahead
    assert held is not None and held.built is not None
    patched: list[int] = []  # the patch's calls
    patch = inputs.ahead._patch
    assert patch is not None
    inputs.ahead._patch = lambda read, edits: (patched.append(len(edits)), patch(read, edits))[1]
    plan.edits.outcome = [rows, *(v for i in range(rows) for v in (i, 0, 50 + i))]
    rows_now, got = inputs(plan)
    assert not patched and (got.graph is not None) == (rows < 300)
    for i, r in enumerate(plan.requests):  # what `settle` makes of the rows after the launch
        r.input_ids[0] = 50 + i
    want = inputs.build(plan, plan_rows(plan.requests, 16))
    for a, b in zip(_tensors(got), _tensors(want), strict=True):
        assert torch.equal(a, b)
    assert np.array_equal(rows_now.input_ids, plan_rows(plan.requests, 16).input_ids)
    assert inputs.ahead.held_share == 1.0  # (counted as a read that held)
    reshaping = _plan(random.Random(9), 4, 1)
    inputs.prepare(reshaping)
    r = reshaping.requests[2]
    reshaping.edits.outcome = [0, 2, r.start_pos, 1, 1, -(r.start_pos // 16 + 1), 61]  # (a record: one token)
    rows_now, _ = inputs(reshaping)
    assert patched == [7] and rows_now.starts[2] == r.start_pos and rows_now.input_ids[2] == 61


def test_a_reshaped_plan_is_built_again_and_no_build_ahead_beside_a_capture() -> None:
    plan = _plan(random.Random(1), 3, 1)
    inputs = CudaLaunchInputs(16, 4096, 4096)
    inputs.prepare(plan)
    r = plan.requests[1]
    r.input_ids.append(5)
    r.num_draft_tokens = 1
    plan.edits.reshaped.append(r)
    _, got = inputs(plan)  # a verify row now: no graph of this shape (q = 2 for one row only)
    assert got.graph is None and got.eager is not None and got.eager[0].tolist()[:4] == [-1, -1, 5, -1]
    first = _plan(random.Random(2), 2, 1)
    inputs.prepare(first)
    _, built = inputs(first)  # its graph's first launch: a real runner captures it, nothing is built beside it
    assert built.graph is not None
    inputs.prepare(_plan(random.Random(3), 2, 1))
    assert inputs.ahead._ahead is not None and inputs.ahead._ahead.built is None
    _, again = inputs(first)
    inputs.prepare(_plan(random.Random(4), 2, 1))
    assert inputs.ahead._ahead is not None and inputs.ahead._ahead.built is not None  # that graph exists now


def _reshape(rng: random.Random, plan: StepPlan) -> None:
    """What `Scheduler.settle` / `add_drafts` do to a plan's rows between its read and its launch, logged: rows fed,
    moved back to fewer tokens (their tables cut to the blocks they still reach), regrown with drafts and new blocks,
    fed after their reshaping."""
    for i, r in enumerate(plan.requests):
        r.input_ids[0] = 11 + i
        plan.edits.fed.append((i, 0, 11 + i))
    for i in sorted(rng.sample(range(len(plan.requests)), max(1, len(plan.requests) // 8)), reverse=True):
        r = plan.requests[i]
        r.start_pos = max(1, r.start_pos - rng.randint(0, 20))
        r.input_ids, r.num_draft_tokens = r.input_ids[:1], 0
        if rng.random() < 0.5:  # redrafted
            r.input_ids += [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
            r.num_draft_tokens = len(r.input_ids) - 1
        need = -(-(r.start_pos + len(r.input_ids)) // 16)
        r.block_table = (r.block_table + [9000 + i * 8 + k for k in range(8)])[:need]
        plan.edits.reshaped.append(r)
        r.input_ids[0] = 7
        plan.edits.fed.append((i, 0, 7))


@pytest.mark.parametrize(("rows", "q", "seed"), [(3, 1, 0), (40, 3, 1), (300, 1, 2), (256, 5, 3)])
def test_a_reshaped_plan_patched_from_its_read_equals_a_fresh_read(rows: int, q: int, seed: int) -> None:
    """The op library's `plan_patch` (csrc/plan_ops.cpp) puts a plan's fed tokens and its reshaped rows into its read
    ahead: the arrays equal reading the rows at the launch, and the launch builds its inputs from them."""
    from tandem.runner.launch_inputs import patched_rows

    rng = random.Random(seed)
    plan = _plan(rng, rows, q)
    inputs = CudaLaunchInputs(16, 4096, 4096)
    assert inputs.ahead._patch is not None  # (the op library is loaded in the test environment)
    inputs.prepare(plan)
    read = inputs.ahead._ahead
    assert read is not None
    _reshape(rng, plan)
    edits = read.edits_flat(plan)
    assert edits is not None
    got, want = patched_rows(read.arrays, edits), plan_rows(plan.requests, 16)
    for name in ("starts", "counts", "wanted", "used", "input_ids", "blocks"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    rows_now, built = inputs(plan)
    assert np.array_equal(rows_now.input_ids, want.input_ids)
    fresh = inputs.build(plan, want)
    assert (built.graph is None) == (fresh.graph is None)
    for a, b in zip(_tensors(built), _tensors(fresh), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("rows", "q", "seed", "graph_q"), [(3, 1, 0, 1), (8, 3, 1, 3), (300, 2, 2, 2), (20, 17, 3, 0)])
def test_a_patched_plans_step_inputs_and_graph_shape_come_from_the_same_call(rows: int, q: int, seed: int,
                                                                              graph_q: int) -> None:
    """`plan_patch_step` (one call at the launch of a reshaped plan): its step inputs equal the op's `step_inputs`
    on a fresh read, and its q is `graph_query_len` of the patched plan (17 tokens a row: past the graphs' longest
    query, 16); a row reshaped to another width leaves no graph's shape."""
    from tandem.layers.kernels import load_cpu_kernels
    from tandem.runner.cuda_graphs import graph_query_len
    from tandem.runner.launch_inputs import patched_step

    assert load_cpu_kernels()
    rng = random.Random(seed)
    plan = _plan(rng, rows, q)
    read = plan_rows(plan.requests, 16)
    r = plan.requests[rows // 2]
    r.start_pos += 1  # moved on a token, same width: the plan keeps its shape
    plan.edits.reshaped.append(r)
    for i in range(rows):
        plan.requests[i].input_ids[0] = 5 + i
        plan.edits.fed.append((i, 0, 5 + i))
    edits = _read_of(plan, read).edits_flat(plan)
    assert edits is not None
    got, step, graph = patched_step(read, edits)
    want = plan_rows(plan.requests, 16)
    fresh = torch.ops.tandem.step_inputs(*map(torch.from_numpy, (want.starts, want.counts, want.wanted, want.used,
                                                                  want.blocks)), 16, DECODE_MAX_QUERY)
    assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.starts, want.starts)
    for a, b in zip(step, fresh, strict=True):
        assert torch.equal(a, b)
    assert graph == graph_q == (graph_query_len(plan) or 0)
    r.input_ids.append(3)  # one row wider than the rest
    r.num_draft_tokens += 1
    r.block_table = r.block_table + [8888]
    assert patched_step(read, _read_of(plan, read).edits_flat(plan) or [])[2] == 0


@pytest.mark.parametrize(("rows", "q"), [(3, 1), (40, 3), (256, 5)])
def test_a_reshaped_plan_of_one_width_is_padded_to_its_graph_from_the_same_call(rows: int, q: int) -> None:
    """A row moved back, same width (the plan keeps a graph's shape): the launch pads the patched arrays to the
    graph when one takes the step (256 x 5 tokens: past a graph's 1,024, eager from the call's step inputs); the
    inputs equal those built from a fresh read."""
    plan = _plan(random.Random(rows), rows, q)
    inputs = CudaLaunchInputs(16, 4096, 4096)
    inputs.prepare(plan)
    r = plan.requests[rows // 2]
    r.start_pos = max(1, r.start_pos - 3)
    plan.edits.reshaped.append(r)
    _, built = inputs(plan)
    fresh = inputs.build(plan, plan_rows(plan.requests, 16))
    assert (built.graph is not None) == (fresh.graph is not None) == (rows * q <= 1024)
    for a, b in zip(_tensors(built), _tensors(fresh), strict=True):
        assert torch.equal(a, b)


def _read_of(plan: StepPlan, arrays: object) -> _Read[None]:
    return _Read(plan, list(plan.requests), {id(r): i for i, r in enumerate(plan.requests)}, arrays, None)  # type: ignore[arg-type]


def test_a_plan_patch_refuses_edits_that_do_not_fit_the_read() -> None:
    from tandem.layers.kernels import load_cpu_kernels
    from tandem.runner.launch_inputs import patched_rows

    assert load_cpu_kernels()
    plan = _plan(random.Random(5), 4, 2)
    read = plan_rows(plan.requests, 16)
    with pytest.raises(RuntimeError, match="fed"):
        patched_rows(read, [1, 9, 0, 5])  # a fed row past the plan
    with pytest.raises(RuntimeError, match="has no input"):
        patched_rows(read, [1, 0, 2, 5])  # a fed index past its row
    with pytest.raises(RuntimeError, match="cut short"):
        patched_rows(read, [0, 1, 5, 1])  # a record cut short
    assert np.array_equal(patched_rows(read, [0]).input_ids, read.input_ids)  # no edits: the read
    with pytest.raises(RuntimeError, match="keeps more blocks"):
        patched_rows(read, [0, 1, 0, 1, 1, -int(read.used[1]) - 1, 7])  # more of its blocks than it was read with


def test_a_reshaped_row_may_keep_the_first_of_the_blocks_it_was_read_with() -> None:
    """A record (row, start, n, wanted, -u, its n ids) keeps the row's first u blocks as read (`settled_edits`'
    form: no block ids read from the rows at the launch): the same arrays as the record that lists them."""
    from tandem.layers.kernels import load_cpu_kernels
    from tandem.runner.launch_inputs import patched_rows

    assert load_cpu_kernels()
    plan = _plan(random.Random(7), 6, 40)
    read = plan_rows(plan.requests, 16)
    row = int(np.argmax(read.used))  # a row of several blocks
    first = int(np.cumsum(read.used)[row] - read.used[row])
    start = int(read.starts[row]) - 16  # moved back a block
    used = start // 16 + 1
    listed = patched_rows(read, [0, row, start, 1, 1, used, 77, *read.blocks[first : first + used].tolist()])
    kept = patched_rows(read, [0, row, start, 1, 1, -used, 77])
    for name in ("starts", "counts", "wanted", "used", "input_ids", "blocks"):
        assert np.array_equal(getattr(kept, name), getattr(listed, name)), name
    assert kept.used[row] == used < read.used[row] and kept.starts[row] == start


def _decoding_ahead(rng: random.Random, n: int):  # type: ignore[no-untyped-def]
    """`n` requests in steady decode with 0-4 drafts each: `cur` reserved (its forward in flight), `nxt` scheduled
    past it with 0-4 drafts a row (reserved, not launched; the last request sits it out), 4-token blocks."""
    from tandem.config import SchedulerConfig
    from tandem.core.kv_blocks import BlockManager
    from tandem.core.scheduler import Scheduler
    from tandem.params import SamplingParams
    from tandem.request import Request

    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=1024, max_model_len=128),
                      BlockManager(512, 4, enable_prefix_caching=False))
    reqs = [Request(f"r{i}", list(range(1, 3 + rng.randrange(9))), SamplingParams(max_tokens=64)) for i in range(n)]
    for req in reqs:
        sched.add(req)
    sched.reserve(pre := sched.schedule())  # the prefills, each sampled 9
    sched.settle(pre, {req.request_id: [9] for req in reqs}, StepPlan(99), [])
    sched.confirm()
    def drafted_plan(first: int, running: frozenset[str] = frozenset(), parked: frozenset[str] = frozenset()):  # type: ignore[no-untyped-def]
        for req in reqs:
            req.draft_token_ids = [first + j for j in range(rng.randrange(5))]
        sched.reserve(plan := sched.schedule(running, parked))
        return plan

    cur = drafted_plan(20)
    # the last request sits the next plan out (alternating groups): its row has no next row
    nxt = drafted_plan(30, frozenset(req.request_id for req in reqs), frozenset({reqs[-1].request_id}))
    return sched, cur, nxt


@pytest.mark.parametrize("seed", range(6))
def test_the_outcome_given_to_a_launch_before_settle_is_what_settle_makes(seed: int) -> None:
    """A plan launched before its rows learn the outcome of the plan before it (`PlanEdits.outcome`): the edits
    `Scheduler.settled_edits` gives its launch, put into its read ahead by the op library's patch, equal reading
    its rows after `settle` has changed them. Every kind of row: fed (all drafts accepted, its drafts kept or it
    has none), stripped of drafts that assumed another outcome, moved back after a rejected draft, no token (a
    request that ended), a reshaped row whose request finished meanwhile (left as it is), a row without a next
    one."""
    from tandem.core.scheduler import pair_rows
    from tandem.layers.kernels import load_cpu_kernels
    from tandem.request import RequestStatus
    from tandem.runner.launch_inputs import patched_rows

    assert load_cpu_kernels()  # (the op library is loaded in the test environment)
    rng = random.Random(seed)
    sched, cur, nxt = _decoding_ahead(rng, 24)
    read = plan_rows(nxt.requests, 4)
    tokens: dict[str, list[int]] = {}
    for sr in cur.requests:
        k = sr.num_draft_tokens
        emitted = rng.randint(1, k + 1)  # the drafts accepted, then one sampled token
        if rng.random() > 0.1:
            tokens[sr.request_id] = [*sr.input_ids[len(sr.input_ids) - k :][: emitted - 1], 40 + rng.randrange(9)]
    keep = {rid for rid in tokens if rng.random() < 0.5}
    sched.finish(cur.requests[seed].request_id, RequestStatus.FINISHED_ABORTED)
    pairs = pair_rows(cur, nxt) if seed % 2 else None  # (taken during the forward, or in the call)
    edits = sched.settled_edits(cur, tokens, nxt, keep, pairs)
    assert plan_rows(nxt.requests, 4).input_ids.tolist() == read.input_ids.tolist()  # nothing changed yet
    changed = sched.settle(cur, tokens, nxt, keep, pairs)
    got, want = patched_rows(read, edits), plan_rows(nxt.requests, 4)
    for name in ("starts", "counts", "wanted", "used", "input_ids", "blocks"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert changed and edits[0] == len(nxt.edits.fed) > 0  # rows of every kind were there
