"""The device-time model: presets at their measured batch-1 rates, memory-bound steps flat in their tokens,
compute-bound ones linear, KV reads and attention counted per plan."""

from __future__ import annotations

import pytest

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.runner.device_model import DEVICE_MODELS, device_model


def test_the_4090_preset_decodes_llama2_7b_at_the_measured_59_tokens_per_second() -> None:
    assert 57.0 < device_model("llama2-7b-rtx4090").batch1_tokens_per_s < 61.0


def test_h200_decodes_8b_near_its_bandwidth_bound() -> None:
    m = device_model("llama3.1-8b-h200")
    bound = m.bandwidth / m.weight_bytes  # every weight read once per step
    assert 0.6 * bound < m.batch1_tokens_per_s < bound


def test_memory_bound_steps_are_flat_and_compute_bound_ones_grow() -> None:
    m = device_model("llama3.1-8b-h200")
    one, few, many = m.step_s(1, 1000, 1000), m.step_s(8, 1000, 8000), m.step_s(4096, 4096, 4096 * 2048)
    assert few == pytest.approx(one, rel=0.01)  # verifying 7 drafts costs about one decode step
    assert many > 20 * one  # a long prefill is arithmetic


def test_a_plan_reads_each_requests_kv_once() -> None:
    m = DEVICE_MODELS["llama2-7b-rtx4090"]
    short = StepPlan(0, [ScheduledRequest("a", [1], 10, [0])])
    long = StepPlan(0, [ScheduledRequest("a", [1], 4000, [0])])
    assert m.plan_s(long) - m.plan_s(short) == pytest.approx(
        m.kv_bytes_per_token * 3990 / (m.bandwidth * m.bandwidth_efficiency), rel=1e-6)


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(ValueError, match="llama2-7b-rtx4090"):
        device_model("gpt-5-on-a-toaster")
