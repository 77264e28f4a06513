"""`tandem serve` and `tandem bench serve`: argparse subcommands (the lead wires them into tandem/cli.py).

Each `add_*_parser(subparsers)` adds its subcommand and sets `func`, a callable taking the argparse namespace and
returning an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}


def parse_size(text: str) -> int:
    """'1048576', '512KiB', '2M', '1.5MB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512KiB, 2MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE (VALUE as JSON, else a string), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags of every `tandem` command (tandem.cli.add_engine_args: model, cache, scheduler, speculative
    decoding), plus the server's extras."""
    from tandem.cli import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("engine (more)")
    g.add_argument("--memory-fraction", type=float, default=0.5, help="KV budget as a fraction of free memory")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides the budget)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the checkpoint's)")
    g.add_argument("--structured-outputs-config", type=json.loads, default=None,
                   help='structured-output settings as JSON, e.g. {"backend": "llguidance"}')
    g.add_argument("--structured-mask-mode", default=None, choices=["cpu", "device"])
    g.add_argument("--engine-arg", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="any other build_engine keyword (VALUE parsed as JSON); repeatable")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """build_engine keywords from the parsed engine flags."""
    from tandem.cli import engine_kwargs

    kw = engine_kwargs(args)
    if kw.get("max_num_batched_tokens") is None and str(kw.get("device", "cpu")).startswith("cpu"):
        # serving on a CPU: a long prompt's prefill is cut into small chunks so the other streams' next tokens
        # never wait seconds behind it (inter-token latency p99 within 3x p50 needs this; see docs/server_soak.md)
        kw["max_num_batched_tokens"] = 128
    kw.update(
        memory_fraction=args.memory_fraction,
        num_kv_blocks=args.num_kv_blocks,
        tokenizer=args.tokenizer,
        structured_outputs_config=args.structured_outputs_config,
        structured_mask_mode=args.structured_mask_mode,
        progress=False,
    )
    kw.update(dict(args.engine_arg))
    return kw


def served_model_names(model: str | None, names: list[str] | None) -> list[str]:
    """--served-model-name, else the model path's basename, else 'tandem-demo' for the built-in model."""
    if names:
        return list(names)
    if model is None:
        return ["tandem-demo"]
    return [Path(model.rstrip("/")).name or model]


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`tandem serve [MODEL] ...`: the OpenAI-compatible HTTP server."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description="Serve a model over an OpenAI-compatible HTTP API."
    )
    p.add_argument("model", nargs="?", default=None, help="checkpoint path (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $TANDEM_API_KEY)")
    p.add_argument("--max-queue", type=int, default=256, help="sequences that may wait beyond --max-num-seqs before 429")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is aborted (504)")
    p.add_argument("--max-body-size", type=parse_size, default=1 << 20, help="request body limit (default 1MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Build the app, start uvicorn, serve until SIGINT / SIGTERM."""
    from tandem.server.api import ServerConfig, create_app, run_server
    from tandem.server.engine_client import EngineClient

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get("TANDEM_API_KEY") or None
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    config = ServerConfig(
        served_model_names=served_model_names(args.model, args.served_model_name),
        api_key=api_key,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_size,
    )
    client = EngineClient(args.model, engine_kwargs_from_args(args))
    app = create_app(client, config)
    run_server(app, args.host, args.port, args.log_level)
    return 0 if client.info is not None else 1


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`tandem bench serve ...`: the load generator (see tandem/bench/serve.py)."""
    from tandem.bench.serve import add_arguments, run_bench_serve

    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="load-test an OpenAI-compatible server", description="Load generator for `tandem serve`."
    )
    add_arguments(p)
    p.set_defaults(func=run_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.server.cli serve ...` / `... bench-serve ...` (until tandem/cli.py wires the subcommands)."""
    parser = argparse.ArgumentParser(prog="python -m tandem.server.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
