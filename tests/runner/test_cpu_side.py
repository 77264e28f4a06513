"""The CPU budget's split of the cores, and the huge-page host allocation of the KV cache."""

from __future__ import annotations

import pytest
import torch

from tandem.cpu_budget import plan_cpu_budget
from tandem.runner.memory import HUGE_PAGE, huge_page_zeros


@pytest.fixture(autouse=True)
def _no_thread_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_NUM_THREADS", raising=False)  # the suite's own cap (conftest)


def test_draft_worker_gets_a_quarter_of_8_cores() -> None:
    b = plan_cpu_budget(draft_on_cpu=True, cores=tuple(range(8)))
    assert b.draft_cores == (6, 7) and b.forward_cores == tuple(range(6))
    assert (b.forward_threads, b.draft_threads, b.grammar_threads) == (6, 2, 2)


def test_two_cores_are_shared() -> None:
    b = plan_cpu_budget(draft_on_cpu=True, cores=(0, 1))
    assert b.draft_cores == (0, 1) and b.forward_cores == (0, 1) and b.draft_threads == 1
    assert plan_cpu_budget(cores=(0, 1)).draft_cores == ()  # no draft model: no worker


def test_explicit_counts_win_and_the_env_caps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NUM_THREADS", "3")
    assert plan_cpu_budget(cores=tuple(range(8))).forward_threads == 3
    assert plan_cpu_budget(cores=tuple(range(8)), forward_threads=5).forward_threads == 5
    assert plan_cpu_budget(cores=(0, 1)).forward_threads == 2  # a cap, never more than the cores
    monkeypatch.setenv("TANDEM_NUM_THREADS", "nonsense")
    assert plan_cpu_budget(cores=tuple(range(8))).forward_threads == 8


def test_huge_page_zeros_are_aligned_zeroed_and_sized() -> None:
    shape = (2, 4, 256, 16, 64)  # a KV cache layer of 4 MiB
    t = huge_page_zeros(shape, torch.bfloat16)
    assert t.data_ptr() % HUGE_PAGE == 0 and t.shape == shape and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()
    small = huge_page_zeros((4, 4), torch.float32)
    assert small.shape == (4, 4) and not small.any()
