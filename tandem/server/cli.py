"""`tandem serve`: the argparse subcommand; `add_serve_parser(subparsers)` adds it and sets `func` (namespace ->
exit code)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from tandem.engine_args import add_engine_args, engine_kwargs, parse_size


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """build_engine keywords from the parsed engine flags, with the server's defaults."""
    kw = engine_kwargs(args)
    if kw.get("max_num_batched_tokens") is None and str(kw.get("device", "cpu")).startswith("cpu"):
        # serving on a CPU: a long prompt's prefill is cut into small chunks so the other streams' next tokens
        # never wait seconds behind it (inter-token latency p99 within 3x p50 needs this; see docs/server_soak.md)
        kw["max_num_batched_tokens"] = 128
    kw["progress"] = False
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
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral", "openai"],
                   help="how the model writes tool calls (default: the chat format's (gpt-oss: openai, harmony's "
                        "messages to functions.NAME) or read off the chat template; Hermes <tool_call> with a "
                        "fallback prompt for templates that know no tools)")
    p.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="on SIGTERM: seconds the requests in flight may run on (health and new requests: 503 draining) "
                        "before they are failed and the server exits; 0: fail them at once (default 30)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores behind this server, each a whole engine (on the CPU: its share of the cores; "
                        "on CUDA: its own device); requests go to the least loaded one, or to the one holding their "
                        "prefix; each restarts on its own. With --distributed-executor-backend ray each core is a "
                        "Ray actor on any node of the cluster")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='chat template keyword arguments for every request, under its own chat_template_kwargs '
                        '(e.g. \'{"enable_thinking": false}\')')
    p.add_argument("--thinking-token-budget", type=int, default=None, metavar="N",
                   help="with --reasoning-parser: thinking tokens a request may write when it gives no "
                        "thinking_token_budget, then the end of the thinking is forced (default: no limit)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def _json_object(text: str) -> dict[str, Any]:
    from tandem.server.reasoning import check_template_kwargs

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    try:
        check_template_kwargs(value, "--default-chat-template-kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def reasoning_parser_name(args: argparse.Namespace) -> str | None:
    """The engine's reasoning parser by name (--reasoning-parser; 'generic' when only --reasoning-markers is given)."""
    name = getattr(args, "reasoning_parser", None)
    return name or ("generic" if getattr(args, "reasoning_markers", None) else None)


def _check_reasoning_parser(args: argparse.Namespace) -> None:
    """A bad --reasoning-parser / --reasoning-markers stops here, before the engine core loads the model."""
    from tandem.engine_args import reasoning_from_args
    from tandem.reasoning import ReasoningError, make_reasoning_parser

    spec = reasoning_from_args(args)
    if spec is not None:
        try:
            make_reasoning_parser(spec)
        except ReasoningError as e:
            raise SystemExit(f"--reasoning-parser: {e}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Build the app, start uvicorn, serve until SIGINT / SIGTERM."""
    from tandem.server.api import ServerConfig, bind_listener, create_app, run_server
    from tandem.server.data_parallel import serving_client

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get("TANDEM_API_KEY") or None
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    if args.shutdown_grace_period < 0:
        raise SystemExit("--shutdown-grace-period must be >= 0")
    if args.thinking_token_budget is not None and args.thinking_token_budget < 0:
        raise SystemExit("--thinking-token-budget must be >= 0")
    _check_reasoning_parser(args)
    config = ServerConfig(
        served_model_names=served_model_names(args.model, args.served_model_name),
        api_key=api_key,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_size,
        tool_call_parser=args.tool_call_parser,
        shutdown_grace_period_s=args.shutdown_grace_period,
        reasoning_parser=reasoning_parser_name(args),
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        thinking_token_budget=args.thinking_token_budget,
    )
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be >= 1")
    try:
        sock = bind_listener(args.host, args.port)  # before the engine: see bind_listener
    except OSError as e:
        raise SystemExit(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None
    client = serving_client(args.model, engine_kwargs_from_args(args), args.data_parallel_size,
                            args.distributed_executor_backend)
    app = create_app(client, config)
    run_server(app, sock, args.log_level)
    return 0 if client.info is not None else 1
