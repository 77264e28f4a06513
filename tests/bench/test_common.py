"""bench/common.py: the request driver says what it could not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.common import drive
from tandem.engine.llm import build_engine
from tandem.params import SamplingParams
from tests.tiny import save_tiny, tiny_model


def test_refused_requests_are_counted_in_the_row_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt id past the vocabulary is refused at add_request (a 4xx in the server): the run goes on with the
    rest, its row counts the refusal and stderr names it (a figure over fewer requests than asked never passes
    silently, as one of Mixtral's two bench prompts once did)."""
    folder = save_tiny(tmp_path / "m", tiny_model("llama"))
    engine = build_engine(str(folder), dtype="float32", kv_cache_memory=8 << 20, max_model_len=64, progress=False)
    try:
        vocab = engine.vocab_size
        res = drive(engine, [[1, 2, 3], [1, vocab + 5]], SamplingParams(max_tokens=4, ignore_eos=True), 2, "t")
    finally:
        engine.shutdown()
    assert res.output_tokens == 4 and res.row()["refused"] == 1
    assert "t: 1 of 2 requests refused" in capsys.readouterr().err
