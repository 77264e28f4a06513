"""`tandem bench simulated`: every mode parses to its configuration, and a replayed run on the demo model's
recorded outputs reports the fields the issue's checks read (mode, concurrency, tok/s, speedup over the run's text
mode, device wait share, acceptance, the share of steps scheduled ahead)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tandem.bench import simulated


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulated.add_parser(parser.add_subparsers())
    return parser.parse_args(["simulated", *extra])


def test_modes_parse_to_their_configuration() -> None:
    args = _args("--spec-k", "3")
    text, guided_suffix = simulated.parse_mode("text", args), simulated.parse_mode("guided+suffix", args)
    assert text.speculative is None and not text.guided
    assert guided_suffix.guided and guided_suffix.speculative is not None
    assert guided_suffix.speculative.method == "suffix" and guided_suffix.speculative.num_speculative_tokens == 3
    seq = simulated.parse_mode("draft-sequential", args, "/x/draft.gguf")
    assert seq.async_scheduling is False and seq.speculative is not None and not seq.speculative.lookahead
    groups = simulated.parse_mode("draft-groups", args, "/x/draft.gguf")
    assert groups.speculative is not None and groups.speculative.alternate_groups is True
    assert simulated.parse_mode("draft", args, "/x/draft.gguf").async_scheduling is None  # ahead (the default)
    restricted = simulated.parse_mode("draft", args, "/x/draft.gguf", 16384).speculative
    assert restricted is not None and restricted.draft_vocab_size == 16384
    assert simulated.draft_paths("/x/draft.gguf,/x/draft.gguf:16384") == {
        "draft.gguf": ("/x/draft.gguf", None), "draft.gguf:16384": ("/x/draft.gguf", 16384)}
    with pytest.raises(ValueError, match="after ':' comes the draft vocabulary"):
        simulated.draft_paths("/x/draft.gguf:lots")
    with pytest.raises(ValueError, match="known: text"):
        simulated.parse_mode("fast", args)


@pytest.mark.slow
@pytest.mark.demo
def test_replayed_run_reports_the_checked_fields(tmp_path: Path, demo_model_dir: Path) -> None:
    """(demo_model_dir: recording needs the demo model; skipped without it.)"""
    out = tmp_path / "sim.json"
    args = _args("--logits", "replay", "--device-model", "llama2-7b-rtx4090", "--workload", "copy",
                 "--concurrency", "2", "--requests", "3", "--output-len", "12",
                 "--modes", "text,suffix,draft,draft-sequential", "--draft-threads", "1", "--json", str(out))
    assert simulated.run(args) == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"text", "suffix", "draft[q4_1]", "draft-sequential[q4_1]"}
    for row in rows.values():
        for key in ("mode", "concurrency", "tok/s", "speedup", "device_wait_%_of_step", "accept",
                    "scheduled_ahead_share"):
            assert key in row, key
        assert row["concurrency"] == 2 and row["tok/s"] > 0
        # the run's start is part of the wait: before its first launch the device had nothing to run
        assert row["run_start_ms"] > 0.0
        assert row["device_wait_after_start_%"] <= row["device_wait_%_of_step"] + 0.1
    assert rows["text"]["speedup"] == 1.0 and rows["text"]["accept"] is None
    assert rows["suffix"]["scheduled_ahead_share"] == 1.0  # drafts and scheduling ahead together
    assert rows["draft-sequential[q4_1]"]["scheduled_ahead_share"] == 0.0
    # a draft model never redrafts: every step with drafts launches its next plan before settling it
    assert rows["draft[q4_1]"]["launched_first_share"] > 0.0 and rows["text"]["launched_first_share"] == 0.0
    assert report["device"] == "llama2-7b-rtx4090" and report["logits"] == "replay"
