"""The `tandem` command line on the real stories260K model (fast): what `generate` streams is what the engine
generates for the same prompt and options; flags reach the engine and the sampler; every subcommand parses to its
own handler."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import build_parser, cmd_demo, cmd_generate, main, sampling_from_args
from tandem.engine.llm import build_engine
from tandem.params import SamplingParams

from .conftest import STORIES_GREEDY


def _engine_text(stories_dir: Path, prompt: str, params: SamplingParams, **kw: object) -> tuple[str, int, str | None]:
    """The reference: the same request through the engine directly."""
    engine = build_engine(str(stories_dir), dtype="float32", progress=False, **kw)  # type: ignore[arg-type]
    engine.add_request("ref", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    engine.shutdown()
    assert final is not None
    o = final.outputs[0]
    return o.text, len(o.token_ids), o.finish_reason


def test_generate_streams_what_the_engine_generates(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "12", "--dtype", "float32",
               "--ignore-eos", "--temperature", "0"])
    out = capsys.readouterr()
    assert rc == 0
    text, n, finish = _engine_text(stories_dir, "Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.out == text + "\n" and text.startswith(",")  # the story goes on: ", there was ..."
    assert f"[{n} tokens, finish_reason={finish}]" in out.err and n == 12


def test_generate_from_bos_gives_the_known_story(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sampling flags reach the sampler: a stop string cuts the known greedy text of stories260K."""
    rc = main(["generate", str(stories_dir), "--prompt", "", "--max-tokens", "60", "--dtype", "float32",
               "--temperature", "0", "--stop", "Lily"])
    out = capsys.readouterr()  # the empty prompt is BOS alone: the tokenizer adds it
    assert rc == 0, out.err
    assert out.out.strip() == STORIES_GREEDY.split("Lily")[0].strip()
    assert "finish_reason=stop" in out.err


def test_generate_with_grammar_and_speculation(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", str(stories_dir), "--prompt", "Once", "--choice", "yes,no", "--speculative-method", "ngram",
               "--dtype", "float32", "--temperature", "0"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip() in ("yes", "no") and "finish_reason=stop" in out.err


def test_bad_input_is_a_clear_error(stories_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(stories_dir), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "/nonexistent/model", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sampling_flags_become_sampling_params() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "p", "--temperature", "0.7", "--top-p", "0.9",
                                      "--max-tokens", "9", "--stop", "\n\n", "--regex", "[a-z]+"])
    p = sampling_from_args(args)
    assert (p.temperature, p.top_p, p.max_tokens, p.stop) == (0.7, 0.9, 9, ("\n\n",))
    assert p.structured_outputs is not None and p.structured_outputs.regex == "[a-z]+"


def test_every_subcommand_parses_to_its_handler() -> None:
    from tandem.bench import serve as bench_serve
    from tandem.bench import simulated, spec, structured, throughput
    from tandem.server.cli import run_serve

    parser = build_parser()
    expected = {
        ("generate", "--prompt", "x"): cmd_generate,
        ("demo",): cmd_demo,
        ("bench", "throughput"): throughput.run,
        ("bench", "structured"): structured.run,
        ("bench", "spec"): spec.run,
        ("bench", "simulated"): simulated.run,
        ("serve",): run_serve,
        ("bench", "serve"): bench_serve.run_bench_serve,
    }
    for argv, handler in expected.items():
        assert parser.parse_args(list(argv)).func is handler, argv
    serve = parser.parse_args(["serve", "--shutdown-grace-period", "5", "--port", "9"])
    assert (serve.shutdown_grace_period, serve.port, serve.model) == (5.0, 9, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "nonsense"])


def test_scale_out_flags_reach_the_engine_and_the_server() -> None:
    from tandem.server.cli import engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--distributed-executor", "ray",
                                      "--data-parallel-size", "3"])
    kw = engine_kwargs_from_args(args)
    assert (kw["tensor_parallel_size"], kw["distributed_executor_backend"], args.data_parallel_size) == (2, "ray", 3)
    assert build_engine.__kwdefaults__["tensor_parallel_size"] == 1  # type: ignore[index]


@pytest.mark.parametrize("flags,message", [
    (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'"),
    (["--reasoning-parser", "qwen3", "--reasoning-markers", "<a>,</a>"], "does not take the options"),
    (["--reasoning-markers", "<a>"], "--reasoning-markers must be START,END"),
])
def test_a_bad_reasoning_parser_stops_serve_before_loading(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["serve", "/nonexistent/model", *flags])
