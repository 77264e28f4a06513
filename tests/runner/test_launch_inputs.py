"""A runner's launch inputs read and built ahead (runner/launch_inputs.py): after the scheduler fed tokens, the inputs
built ahead with the fed ids put in equal the inputs built at the launch; reshaped plans are built again."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.core.plan_arrays import plan_rows
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
