"""The `tandem` command line on the real stories260K model (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import build_parser, main


def test_generate_streams_text(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "12", "--dtype", "float32",
               "--ignore-eos"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.strip().startswith(",") or len(out.out.strip()) > 0
    assert "12 tokens, finish_reason=length" in out.err


def test_generate_with_grammar_and_speculation(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", str(stories_dir), "--prompt", "Once", "--choice", "yes,no", "--speculative-method", "ngram",
               "--dtype", "float32"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip() in ("yes", "no")


def test_bad_input_is_a_clear_error(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(stories_dir), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "/nonexistent/model", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_every_subcommand_parses() -> None:
    parser = build_parser()
    for argv in (["demo"], ["bench", "throughput"], ["bench", "structured"], ["bench", "spec"], ["serve"],
                 ["bench", "serve"]):
        assert parser.parse_args(argv).func is not None
