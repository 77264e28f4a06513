"""The tensor thread: one thread for all host tensor work, re-entrant."""

from __future__ import annotations

import threading

import pytest

from tandem.runner.tensor_thread import on_tensor_thread, tensor_thread


def test_runs_on_one_thread_and_nests_without_deadlock() -> None:
    me = threading.get_ident()
    first = on_tensor_thread(threading.get_ident)
    assert first != me and on_tensor_thread(threading.get_ident) == first
    # a call made from the tensor thread runs inline (a submit-and-wait there would deadlock)
    assert on_tensor_thread(lambda: on_tensor_thread(threading.get_ident)) == first
    assert on_tensor_thread(lambda: tensor_thread().submit(threading.get_ident).result(timeout=5)) == first


def test_exceptions_reach_the_caller() -> None:
    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        on_tensor_thread(boom)
    with pytest.raises(ValueError, match="boom"):
        on_tensor_thread(lambda: tensor_thread().submit(boom).result())


def test_model_runner_forwards_on_the_tensor_thread() -> None:
    import torch

    from tandem.config import CacheConfig, SchedulerConfig
    from tandem.core.plan import ScheduledRequest, StepPlan
    from tandem.runner.runner import ModelRunner
    from tests.models.test_parity import _tiny

    model = _tiny("llama")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    from tandem.config import ModelConfig

    cfg = ModelConfig.from_hf(model.config.to_dict())
    runner = ModelRunner(cfg, weights, torch.float32, "cpu", CacheConfig(num_blocks=8, block_size=4), SchedulerConfig(max_model_len=32))
    seen: list[int] = []
    forward = runner.model.forward
    runner.model.forward = lambda *a: (seen.append(threading.get_ident()), forward(*a))[1]  # type: ignore[method-assign]
    runner.execute(StepPlan(0, [ScheduledRequest("a", [1, 2, 3], 0, [0, 1])]))
    assert seen == [on_tensor_thread(threading.get_ident)]
