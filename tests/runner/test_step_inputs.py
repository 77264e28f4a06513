"""The launch's vectorised input builders (core/plan_arrays.py) give the tensors the per-row, per-token builders they
replaced gave (kept below as the references), on random plans: decode and verify rows, prefills, chunks with and
without cached keys, every attention path and the CUDA-graph padding."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.plan_arrays import plan_rows
from tandem.layers.attention import DECODE_MAX_QUERY, build_metadata
from tandem.runner.cuda_graphs import GraphedSteps


def _random_plan(rng: random.Random, rows: int, block_size: int, decode_only: bool = False, q: int | None = None) -> StepPlan:
    plan = StepPlan(rng.randint(0, 9))
    for i in range(rows):
        if q is not None:
            n, start = q, rng.randint(1, 300)
        elif decode_only or rng.random() < 0.7:
            n, start = rng.randint(1, 5), rng.randint(1, 300)
        else:
            n, start = rng.choice([rng.randint(1, 40), DECODE_MAX_QUERY + 1]), rng.choice([0, rng.randint(1, 200)])
        need = -(-(start + n) // block_size)
        blocks = rng.sample(range(2000), need + rng.randint(0, 3))  # a row may hold more blocks than it reaches
        drafts = min(n - 1, rng.randint(0, 4)) if start > 0 else 0
        plan.requests.append(ScheduledRequest(f"r{i}", [rng.randrange(1000) for _ in range(n)], start, blocks, drafts,
                                              needs_logits=rng.random() < 0.9, all_logits=rng.random() < 0.05))
    return plan


# ------------------------------------------------------------------ the references: the builders before vectorising
def _reference_metadata(plan: StepPlan, bs: int, gathered: bool, paged: bool) -> dict[str, Any]:
    positions: list[int] = []
    slots: list[int] = []
    prefills, decodes = [], []
    row = 0
    for r in plan.requests:
        n, start, bt = r.num_tokens, r.start_pos, r.block_table
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(bt[p // bs] * bs + p % bs for p in pos)
        entry = (row, n, start, bt[: (start + n + bs - 1) // bs])
        (decodes if n <= DECODE_MAX_QUERY and start > 0 else prefills).append(entry)
        row += n
    out: dict[str, Any] = {"positions": torch.tensor(positions), "slots": torch.tensor(slots),
                           "prefills": [(slice(r0, r0 + n), s, torch.tensor(b) if s > 0 else None)
                                        for r0, n, s, b in prefills]}
    if decodes:
        q_max = max(n for _, n, _, _ in decodes)
        b_max = max(len(b) for _, _, _, b in decodes)
        out["block_tables"] = torch.tensor([b + [b[-1]] * (b_max - len(b)) for _, _, _, b in decodes])
        out["seq_info"] = torch.tensor([(r0, n, s) for r0, n, s, _ in decodes])
        out["q_max"], out["key_len"], out["dense"] = q_max, b_max * bs, not prefills and all(n == q_max for _, n, _, _ in decodes)
        if gathered or paged:
            out["token_index"] = torch.tensor([r0 + min(j, n - 1) for r0, n, _, _ in decodes for j in range(q_max)])
            out["query_pos"] = torch.tensor([[s + min(j, n - 1) for j in range(q_max)] for _, n, s, _ in decodes])
            out["flat_index"] = torch.tensor([i * q_max + j for i, (_, n, _, _) in enumerate(decodes) for j in range(n)])
            out["out_rows"] = torch.tensor([x for r0, n, _, _ in decodes for x in range(r0, r0 + n)])
        if paged:
            out["paged_counts"] = torch.tensor([len(b) for _, _, _, b in decodes], dtype=torch.int32)
            out["paged_tables"] = out["block_tables"].to(torch.int32)
    return out


def _reference_pad(plan: StepPlan, bucket: int, q: int, bs: int, scratch: int, width: int) -> list[torch.Tensor]:
    ids, pos, slots, counts, qpos, tables = [], [], [], [], [], []
    for r in plan.requests:
        held = (r.start_pos + q + bs - 1) // bs
        p = range(r.start_pos, r.start_pos + q)
        ids += r.input_ids
        pos += p
        slots += [r.block_table[i // bs] * bs + i % bs for i in p]
        counts.append(held)
        qpos.append(list(p))
        tables.append(r.block_table[:held] + [r.block_table[held - 1]] * (width - held))
    pad = bucket - len(plan.requests)
    ids += [0] * (pad * q)
    pos += [0] * (pad * q)
    slots += [scratch * bs + min(j, bs - 1) for _ in range(pad) for j in range(q)]
    counts += [1] * pad
    qpos += [[0] * q] * pad
    tables += [[scratch] * width] * pad
    return [torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), torch.tensor(counts, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32), torch.tensor(qpos)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("gathered,paged,kernel", [(False, False, False), (True, False, False), (False, True, False),
                                                   (False, True, True)])
@pytest.mark.parametrize("seed", range(6))
def test_metadata_equals_the_per_token_builder(seed: int, gathered: bool, paged: bool, kernel: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention path; the paged one also through the op library's one-call builder (csrc/plan_ops.cpp)."""
    from tandem.layers import attention
    from tandem.layers.kernels import load_cpu_kernels

    if kernel and not load_cpu_kernels():
        pytest.skip("tandem's CPU op library is not built here")
    if not kernel:
        monkeypatch.setattr(attention, "_step_op", lambda: None)
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    plan = _random_plan(rng, rng.choice([1, 3, 40, 256]), bs, decode_only=seed % 2 == 0)
    ref = _reference_metadata(plan, bs, gathered, paged)
    meta = build_metadata(plan, bs, torch.device("cpu"), gathered_decode=gathered, paged_decode=paged)
    assert meta.num_tokens == plan.num_tokens
    assert _same(meta.positions, ref["positions"]) and _same(meta.slot_mapping, ref["slots"])
    assert len(meta.prefills) == len(ref["prefills"])
    for got, (rows, start, blocks) in zip(meta.prefills, ref["prefills"], strict=True):
        assert got.token_slice == rows and got.start_pos == start and type(got.start_pos) is int
        assert (got.key_blocks is None and blocks is None) or _same(got.key_blocks, blocks)
    g = meta.decode
    assert (g is None) == ("q_max" not in ref)
    if g is None:
        return
    assert (g.q_max, g.key_len, g.batch, g.dense) == (ref["q_max"], ref["key_len"], len(ref["seq_info"]), ref["dense"])
    assert _same(g.block_tables, ref["block_tables"]) and _same(g.seq_info, ref["seq_info"])
    for name in ("token_index", "query_pos", "flat_index", "out_rows"):
        if name in ref:
            assert _same(getattr(g, name), ref[name]), name
    if paged:
        assert g.paged is not None
        assert _same(g.paged.num_blocks, ref["paged_counts"]) and _same(g.paged.block_tables, ref["paged_tables"])
        assert _same(g.paged.query_pos, ref["query_pos"])
    if gathered:
        assert _same(g.key_blocks, ref["block_tables"].view(-1))


@pytest.mark.parametrize("seed", range(4))
def test_graph_inputs_equal_the_per_token_padding(seed: int) -> None:
    rng = random.Random(seed)
    bs, q = rng.choice([4, 16]), rng.choice([1, 2, 5])
    plan = _random_plan(rng, rng.choice([1, 5, 200]), bs, q=q)
    width = max(len(r.block_table) for r in plan.requests) + rng.randint(0, 40)
    bucket = len(plan.requests) + rng.randint(0, 7)
    graphs = GraphedSteps(forward=lambda *_: torch.empty(0), capture=lambda fn: (None, fn()), device=torch.device("cpu"),
                          block_size=bs, scratch_block=4321, max_blocks=width)
    got = graphs._pad(plan_rows(plan.requests, bs), bucket, q)
    want = _reference_pad(plan, bucket, q, bs, 4321, width)
    names = ("input_ids", "positions", "slots", "num_blocks", "block_tables", "query_pos")
    for name, ref in zip(names, want, strict=True):
        assert _same(getattr(got, name), ref), name
    assert got.key == (bucket, q) and got.num_rows == len(plan.requests) * q


def test_input_ids_and_logits_rows() -> None:
    plan = _random_plan(random.Random(7), 60, 16)
    rows = plan_rows(plan.requests, 16)
    assert rows.input_ids.tolist() == [t for r in plan.requests for t in r.input_ids]
    want, row0 = [], 0
    for r in plan.requests:
        end = row0 + r.num_tokens
        want.extend(range(end - r.num_logits_rows, end))
        row0 = end
    assert rows.logits_rows().tolist() == want and want


def test_tables_repeat_each_rows_last_used_block() -> None:
    plan = StepPlan(0, [ScheduledRequest("a", [1, 2], 4, [5, 6, 7]), ScheduledRequest("b", [1], 2, [8]),
                        ScheduledRequest("c", [1], 5, [9, 10, 11])])
    rows = plan_rows(plan.requests, 4)
    assert rows.used.tolist() == [2, 1, 2]
    assert rows.tables(4).tolist() == [[5, 6, 6, 6], [8, 8, 8, 8], [9, 10, 10, 10]]


def _edit_rows(plan: StepPlan, log: bool, withdraw: bool = True) -> None:
    """What scheduling ahead does to a plan between its read and its launch, logged in `plan.edits` as the
    scheduler logs it (unless not `log`): rows fed (before and after their reshaping), moved back (fewer tokens, a
    shorter table), regrown with drafts and other blocks, and one withdrawn (with `withdraw`)."""
    edits = plan.edits if log else StepPlan(0).edits
    r0, r1, r2 = plan.requests[0], plan.requests[1], plan.requests[2]
    r0.input_ids[0] = 66
    edits.fed.append((0, 0, 66))
    r0.input_ids, r0.num_draft_tokens = r0.input_ids[:1], 0
    r0.block_table = r0.block_table[: -(-(r0.start_pos + 1) // 4)]
    r1.input_ids += [1, 2, 3, 4]
    r1.num_draft_tokens += 4
    need = -(-(r1.start_pos + len(r1.input_ids)) // 4)
    r1.block_table = r1.block_table[: need - 2] + [9999, 9998]
    edits.reshaped += [r1, r0]
    r1.input_ids[-1] = 44
    edits.fed.append((1, len(r1.input_ids) - 1, 44))
    r5 = plan.requests[5]
    r5.start_pos -= 1
    edits.reshaped.append(r5)
    if withdraw:
        del plan.requests[2]
        edits.withdrawn.append(r2)
    for i in range(3, 10):
        plan.requests[i].input_ids[0] = 77
        edits.fed.append((i, 0, 77))


@pytest.mark.raw_inputs_ahead
@pytest.mark.parametrize("edit", ["fed", "reshaped", "reshaped and withdrawn"])
def test_a_plan_read_ahead_and_its_edits_give_the_arrays_at_the_launch(edit: str) -> None:
    """`InputsAhead.prepare` while the plan waits, `rows` at its launch: the same arrays as reading the rows then,
    after the edits scheduling ahead makes (only fed tokens; rows fed, moved back and regrown, the reshaped rows
    read again alone; and one withdrawn, the plan read again) — negative control: an edit to a row the scheduler did
    not log is not seen."""
    from tandem.core.plan_arrays import InputsAhead

    for log in (True, False):
        plan = _random_plan(random.Random(3), 50, 4, decode_only=True)
        ahead = InputsAhead(4)
        ahead.prepare(plan)
        if edit == "fed":
            for i in range(0, len(plan.requests), 3):
                plan.requests[i].input_ids[0] = 55
                (plan.edits if log else StepPlan(0).edits).fed.append((i, 0, 55))
        else:
            _edit_rows(plan, log, withdraw=log and edit == "reshaped and withdrawn")
        got, want = ahead.take(plan)[0], plan_rows(plan.requests, 4)
        same = [np.array_equal(getattr(got, name), getattr(want, name))
                for name in ("starts", "counts", "wanted", "used", "input_ids", "blocks")]
        assert all(same) == log and got.request_ids == want.request_ids
        assert {9999, 9998} <= set(got.blocks.tolist()) or not (edit != "fed" and log)


@pytest.mark.raw_inputs_ahead
def test_a_row_withdrawn_unlogged_reads_the_plan_again() -> None:
    """A plan with fewer rows than were read is read again whole, whether or not the withdrawal was logged."""
    from tandem.core.plan_arrays import InputsAhead

    plan = _random_plan(random.Random(4), 12, 4, decode_only=True)
    ahead = InputsAhead(4)
    ahead.prepare(plan)
    del plan.requests[3]
    got = ahead.take(plan)[0]
    assert got.request_ids == plan_rows(plan.requests, 4).request_ids and len(got.starts) == 11


@pytest.mark.raw_inputs_ahead
def test_a_read_ahead_is_used_once_and_only_for_its_plan() -> None:
    from tandem.core.plan_arrays import InputsAhead

    plan, other = (_random_plan(random.Random(s), 8, 4, decode_only=True) for s in (1, 2))
    ahead = InputsAhead(4)
    ahead.prepare(plan)
    plan.requests[0].input_ids[0] = 5  # not logged: a second launch of the plan reads the rows again
    assert np.array_equal(ahead.take(other)[0].input_ids, plan_rows(other.requests, 4).input_ids)
    assert np.array_equal(ahead.take(plan)[0].input_ids, plan_rows(plan.requests, 4).input_ids)


@pytest.mark.parametrize("seed", range(4))
def test_a_graphs_fit_from_the_arrays_is_graph_query_len(seed: int) -> None:
    from tandem.runner.cuda_graphs import _query_len, graph_query_len

    rng = random.Random(seed)
    for _ in range(40):
        q = rng.choice([None, 1, 3])
        plan = _random_plan(rng, rng.randint(1, 6), 4, decode_only=rng.random() < 0.5, q=q)
        for r in plan.requests:
            if q is not None and rng.random() < 0.8:  # verify rows wanting every row: graph candidates
                r.num_draft_tokens, r.needs_logits, r.all_logits = q - 1, True, False
        assert _query_len(plan_rows(plan.requests, 4)) == graph_query_len(plan)
    assert _query_len(plan_rows([], 4)) is None
