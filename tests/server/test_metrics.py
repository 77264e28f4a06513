"""Engine stats become Prometheus metrics: speculative decoding under vLLM's counter names (so its dashboards
read them), scheduling ahead and device idle under tandem's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.server.metrics import EngineStatsCollector, ServerMetrics


def _render(stats: dict) -> dict[str, float]:  # type: ignore[type-arg]
    metrics = ServerMetrics(EngineStatsCollector(lambda: stats, lambda: True, lambda: None))
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
                                 if sample.labels else "")
            out[key] = sample.value
    return out


def test_spec_decode_counters_take_vllms_names() -> None:
    m = _render({"spec_num_drafts": 10, "spec_num_drafted": 40, "spec_num_accepted": 25,
                 "spec_accepted_per_position": [9, 8, 5, 3], "steps_scheduled_ahead": 12,
                 "spec_optimistic_misses": 4, "device_idle_ms_per_step": 0.25, "steps_launched_before_settle": 7})
    assert m["vllm:spec_decode_num_drafts_total"] == 10
    assert m["vllm:spec_decode_num_draft_tokens_total"] == 40
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == 25
    assert [m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)] == [9, 8, 5, 3]
    assert m["tandem_steps_scheduled_ahead"] == 12 and m["tandem_spec_optimistic_misses"] == 4
    assert m["tandem_device_idle_ms_per_step"] == 0.25 and m["tandem_steps_launched_before_settle"] == 7


def test_no_speculation_no_spec_counters() -> None:
    m = _render({"num_running": 1, "steps_scheduled_ahead": 0})
    assert not any(k.startswith("vllm:spec_decode") for k in m)
