"""The simulated accelerator (benchmarks): its forward ends `step_s` (or its device model's time) after launch
whatever the host does; in `rows_by_token` mode a row's logits depend on its own input token alone, and replayed
logits make a greedy request emit its recording."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.runner.simulated import SimulatedRunner


def _plan(last_tokens: list[int]) -> StepPlan:
    return StepPlan(step_id=0, requests=[ScheduledRequest(f"r{i}", [t], start_pos=5, block_table=[0])
                                         for i, t in enumerate(last_tokens)])


def test_the_forward_ends_on_time_and_a_late_host_is_not_the_device() -> None:
    runner = SimulatedRunner(vocab_size=64, num_blocks=4, step_s=0.05)
    t0 = time.perf_counter()
    handle = runner.launch(_plan([1, 2]))
    logits = runner.collect(handle)  # early: waits for the forward
    waited = time.perf_counter() - t0
    assert logits.shape == (2, 64)
    assert 0.05 <= waited < 0.05 + 0.02
    assert abs(handle.finished_at - (t0 + 0.05)) < 2e-3  # the forward's end, not when the host woke

    handle = runner.launch(_plan([3]))
    time.sleep(0.08)  # the host is late: the forward still ended 0.05 s after its launch
    runner.collect(handle)
    assert time.perf_counter() - handle.finished_at >= 0.03


def test_a_forward_launched_while_another_runs_starts_at_its_end() -> None:
    """One forward after another, as a stream runs its kernels: a forward launched before the one before it ended
    (that one thrown away uncollected) ends a step after it, not a step after its own launch."""
    runner = SimulatedRunner(vocab_size=64, num_blocks=4, step_s=0.04)
    t0 = time.perf_counter()
    runner.launch(_plan([1]))  # never collected
    handle = runner.launch(_plan([2]))
    runner.collect(handle)
    assert handle.finished_at - t0 >= 0.08 - 1e-3
    assert runner.device_s == pytest.approx(0.08)


def test_rows_by_token_follow_the_input_token_not_the_batch() -> None:
    runner = SimulatedRunner(vocab_size=32, num_blocks=4, step_s=0.0, table_rows=16, rows_by_token=True)
    alone = runner.collect(runner.launch(_plan([7])))
    batch = runner.collect(runner.launch(_plan([3, 7, 7 + 16])))
    assert torch.equal(batch[1], alone[0]) and torch.equal(batch[2], alone[0])  # token % table_rows picks the row
    assert not torch.equal(batch[0], alone[0])


def test_replayed_logits_put_the_recorded_token_on_top() -> None:
    """Each row's argmax is the recording's token after the row's position; an unknown request or a position past
    the recording gets the end token."""
    from tandem.runner.simulated import ReplayLogits

    replay = ReplayLogits(vocab_size=300, end_token=2)
    replay.expect("r0", [5, 6, 7, 100, 101, 102])  # prompt [5, 6, 7], then the recorded output
    runner = SimulatedRunner(vocab_size=300, num_blocks=4, step_s=0.005, logits=replay)
    plan = StepPlan(step_id=0, requests=[
        ScheduledRequest("r0", [7, 100, 55], start_pos=2, block_table=[0], num_draft_tokens=2),  # verify: 3 rows
        ScheduledRequest("r0x", [9], start_pos=4, block_table=[1]),  # unknown: the end token
        ScheduledRequest("r0", [102], start_pos=5, block_table=[0]),  # past the recording
    ])
    logits = runner.collect(runner.launch(plan))
    assert logits.shape == (5, 300)
    assert logits.argmax(dim=-1).tolist() == [100, 101, 102, 2, 2]
    runner.shutdown()


@pytest.mark.parametrize("reserved", [0, 9])
def test_replayed_rows_stay_as_built_until_the_ring_comes_back_round(reserved: int) -> None:
    """The replayed rows are written into a ring of `REPLAY_BUFFERS` buffers, only the marked cells touched a time:
    every build's argmax is its targets, whatever the row counts before, and a forward's rows stay as they were
    while the next two are built (the engine reads them during the next forward). With room reserved for the most
    rows ahead, no buffer is made again."""
    import torch

    from tandem.runner.simulated import REPLAY_BUFFERS, ReplayLogits

    replay = ReplayLogits(vocab_size=300, end_token=2, noise_rows=4)
    replay.reserve(reserved)
    memory = {b[0].data_ptr() for b in replay._buffers if b is not None}
    g = torch.Generator().manual_seed(0)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for rows in (5, 3, 9, 9, 2, 7, 7, 1):
        targets = torch.randint(0, 300, (rows,), generator=g)
        out = replay._build(targets)
        assert out.shape == (rows, 300) and torch.equal(out.argmax(dim=-1), targets)
        kept.append((out, out.clone()))
        for logits, copy in kept[-REPLAY_BUFFERS:]:  # this build and the two before it: untouched
            assert torch.equal(logits, copy)
    if reserved:
        assert len(memory) == REPLAY_BUFFERS and {b[0].data_ptr() for b in replay._buffers if b is not None} == memory


def test_replayed_targets_from_a_plans_arrays_are_those_of_its_keys() -> None:
    """The recorded tokens looked up from a plan's arrays (`prepare_rows`) equal those looked up row by row from its
    keys: requests with and without recordings, verify and decode rows, positions past a recording's end, a
    recording forgotten, one added after the first lookup."""
    import random

    from tandem.core.plan_arrays import plan_rows
    from tandem.runner.simulated import ReplayLogits, _keys_of

    rng = random.Random(0)
    replay = ReplayLogits(vocab_size=300, end_token=2)
    for i in range(12):
        replay.expect(f"r{i}", [rng.randrange(300) for _ in range(rng.randint(1, 40))])
    for round_ in range(20):
        if round_ == 5:
            replay.forget("r3")
        if round_ == 10:
            replay.expect("r12", [rng.randrange(300) for _ in range(30)])
        plan = StepPlan(step_id=round_)
        for j in range(rng.randint(1, 10)):
            n, start = rng.randint(1, 5), rng.randint(0, 45)
            plan.requests.append(ScheduledRequest(f"r{rng.randrange(14)}", [rng.randrange(300) for _ in range(n)],
                                                  start, [j], num_draft_tokens=rng.randint(0, n - 1)))
        rows = plan_rows(plan.requests, 16)
        assert replay._targets_of(rows).tolist() == replay._targets(_keys_of(rows)).tolist()


def test_a_device_model_times_each_forward_by_its_plan() -> None:
    from tandem.runner.device_model import device_model

    model = device_model("llama2-7b-rtx4090")
    runner = SimulatedRunner(vocab_size=32, num_blocks=4, device_model=model)
    plan = _plan([1, 2])
    t0 = time.perf_counter()
    handle = runner.launch(plan)
    runner.collect(handle)
    assert handle.finished_at - t0 == pytest.approx(model.plan_s(plan), abs=3e-3)
    assert runner.device_s == pytest.approx(model.plan_s(plan))


def test_a_launch_builds_what_a_cuda_runners_launch_builds_on_the_host() -> None:
    """`CudaLaunchInputs`: a decode step that fits a CUDA graph gets the graph's padded inputs, any other step the
    eager inputs of FlexAttention's paged decode; the simulated launch builds them before its forward 'starts'."""
    from tandem.core.plan_arrays import PlanRows
    from tandem.runner.cuda_graphs import GraphInputs
    from tandem.runner.launch_inputs import StepInputs
    from tandem.runner.simulated import CudaLaunchInputs

    inputs = CudaLaunchInputs(block_size=16, max_model_len=4096, num_blocks=512)
    decode = StepPlan(0, [ScheduledRequest(f"r{i}", [7], 20 + i, [i, i + 100]) for i in range(3)])
    _, built = inputs(decode)
    padded = built.graph
    assert isinstance(padded, GraphInputs) and padded.key == (4, 1) and padded.block_tables.shape == (4, 257)
    mixed = StepPlan(1, decode.requests + [ScheduledRequest("p", list(range(40)), 0, [300, 301, 302])])
    _, built = inputs(mixed)
    assert built.eager is not None and built.graph is None
    ids, meta, rows = built.eager
    assert ids.tolist() == [7, 7, 7, *range(40)] and rows.tolist() == [0, 1, 2, 42]
    assert meta.decode is not None and meta.decode.paged is not None and len(meta.prefills) == 1

    built: list[StepPlan] = []

    class Recorded(CudaLaunchInputs):
        def __call__(self, plan: StepPlan) -> tuple[PlanRows, StepInputs]:
            built.append(plan)
            return super().__call__(plan)

    runner = SimulatedRunner(64, num_blocks=512, step_s=0.001, launch_inputs=Recorded(16, 4096, 512))
    runner.collect(runner.launch(decode))
    assert built == [decode]
