"""The runner waits for its own device: a runner on cuda:1 synchronizes cuda:1's stream, not the current device's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.runner import runner as runner_mod
from tandem.runner.runner import on_device, wait_for_device


class _FakeStream:
    def __init__(self, device: Any, log: list[tuple[str, Any]]) -> None:
        self.device, self.log = device, log

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.device))


def test_wait_for_device_synchronizes_the_runners_device(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(runner_mod.torch.cuda, "current_stream", lambda device=None: _FakeStream(device, log))
    wait_for_device(torch.device("cuda:1"))
    assert log == [("synchronize", torch.device("cuda:1"))]
    wait_for_device(torch.device("cpu"))  # nothing queued on the host: no CUDA call at all
    assert len(log) == 1


def test_on_device_switches_to_the_runners_device_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[Any] = []

    class _FakeDevice:
        def __init__(self, device: Any) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(runner_mod.torch.cuda, "device", _FakeDevice)
    with on_device(torch.device("cuda:1")):
        pass
    with on_device(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda:1")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_wait_for_device_on_cuda_leaves_no_work_queued() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last device: not the current one when > 1
    x = torch.randn(2048, 2048, device=device)
    for _ in range(8):
        x = x @ x / 2048
    wait_for_device(device)
    assert torch.cuda.current_stream(device).query()
