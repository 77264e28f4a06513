"""`tandem` command line: generate | demo | bench | serve."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.params import ParamError, SamplingParams, StructuredOutputsParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    s = p.add_argument_group("structured outputs")
    s.add_argument("--json-schema", type=Path, default=None, help="file holding a JSON schema")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", default=None)
    s.add_argument("--choice", default=None, help="comma-separated choices")
    s.add_argument("--grammar", type=Path, default=None, help="file holding a GBNF/EBNF or Lark grammar")
    s.add_argument("--grammar-backend", default=None, choices=["auto", "xgrammar", "llguidance"])


def structured_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    kw: dict[str, Any] = {}
    if args.json_schema is not None:
        kw["json"] = _read(args.json_schema)
    if args.json_object:
        kw["json_object"] = True
    if args.regex is not None:
        kw["regex"] = args.regex
    if args.choice is not None:
        kw["choice"] = [c for c in args.choice.split(",")]
    if args.grammar is not None:
        kw["grammar"] = _read(args.grammar)
    if not kw:
        return None
    return StructuredOutputsParams(**kw, backend=args.grammar_backend)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_from_args(args),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ParamError(f"cannot read {path}: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.demo.common import stream_to_terminal
    from tandem.engine.llm import build_engine

    params = sampling_from_args(args)
    engine = build_engine(args.model, **engine_kwargs(args))
    tok = engine.tokenizer
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    final = stream_to_terminal(engine, "cli", prompt, params)
    sys.stdout.write("\n")
    if final is not None:
        o = final.outputs[0]
        if final.error:
            print(f"[error: {final.error}]", file=sys.stderr)
            return 1
        print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tandem.demo.tour import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference with the CPU as a co-processor")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("model", nargs="?", default=None, help="HF folder, .gguf or llama2.c .bin (default: the demo model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="a short tour of what works, on the built-in demo model")
    demo.add_argument("--quick", action="store_true", help="smaller workloads")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from tandem.bench import simulated, spec, structured, throughput, tools

    for module in (throughput, structured, spec, simulated, tools):
        module.add_parser(bsub)
    _server_parsers(sub, bsub)
    return parser


def _server_parsers(sub: Any, bsub: Any) -> None:
    """`serve` and `bench serve` need the server extras (fastapi, uvicorn, httpx)."""
    try:
        from tandem.bench import serve as bench_serve
        from tandem.server import cli as server_cli
    except ImportError:
        return
    server_cli.add_serve_parser(sub)
    bench_serve.add_parser(bsub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ParamError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_sampling_args", "main", "sampling_from_args"]
