"""Engine flags shared by every command that builds an engine (`tandem generate`, `serve`, `bench ...`).

`add_engine_args(parser)` adds them; `engine_kwargs(args)` turns the parsed namespace into `build_engine` keywords.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """'1048576', '512KiB', '2M', '1.5GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512KiB, 2MiB, 1GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE (VALUE as JSON, else a string), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def offload_setting(text: str) -> int | str:
    """--cpu-offload-experts: 'all' or a number of layers >= 0 (as `layers/moe_offload.check_offload_setting` reads it;
    not imported here: the flags parse without torch)."""
    value = text.strip().lower()
    if value == "all":
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"--cpu-offload-experts wants 'all' or a number of layers >= 0, got {text!r}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, cache, scheduler, structured-output and speculative-decoding flags."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="torch device of the forward pass (cpu, cuda, cuda:1, ...)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the checkpoint's)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_size, default=None,
                   help="KV cache size (bytes, or e.g. 1GiB); default: max-num-seqs x max-model-len tokens, capped by "
                        "--memory-fraction")
    g.add_argument("--memory-fraction", "--gpu-memory-utilization", type=float, default=None,
                   help="cap of the default KV cache: this fraction of the memory free after loading the weights "
                        "(default 0.5; on the host also at most 4 GiB unless this is given)")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache size in blocks (overrides the rest)")
    g.add_argument("--quantization", "-q", default=None, choices=["auto", "gguf", "none", "int8"],
                   help="auto / gguf: a GGUF's quantized tensors stay quantized (default); none: dequantize them to "
                        "--dtype; int8: store safetensors matrices as per-channel int8")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch threads of the forward (default: all cores)")
    g.add_argument("--cpu-offload-experts", type=offload_setting, default=None, metavar="all|N",
                   help="mixture-of-experts models beside an accelerator: keep the experts (and routers) of all MoE "
                        "layers, or of those below layer N (llama.cpp's --n-cpu-moe N), in host memory and run them "
                        "on the host's cores (no CUDA graphs then); the normal path on a CPU device; a no-op, logged, "
                        "on a model without experts")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (worker processes over torch.distributed: gloo on the "
                        "CPU, each rank on its share of the cores; NCCL on CUDA, one device per rank)")
    g.add_argument("--distributed-executor-backend", "--distributed-executor", default="mp", choices=["mp", "ray"],
                   help="where the tensor-parallel worker ranks (and, with tandem serve --data-parallel-size > 1, "
                        "the engine cores) run: local processes (mp) or Ray actors on the cluster at $RAY_ADDRESS, "
                        "else a local Ray instance (ray; pip install ray)")
    g.add_argument("--chat-template", default=None, help="Jinja chat template text or file")
    g.add_argument("--structured-outputs-config", type=json.loads, default=None,
                   help='structured-output settings as JSON, e.g. {"backend": "llguidance"}; '
                        '{"enable_in_reasoning": true}: grammars hold the thinking too')
    g.add_argument("--structured-mask-mode", default=None, choices=["cpu", "device"])
    g.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="schedule each step while the previous one runs (default: on for accelerators, no drafts)")
    g.add_argument("--engine-arg", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="any other build_engine keyword (VALUE parsed as JSON); repeatable")
    _add_reasoning_and_speculative_args(p)


def _add_reasoning_and_speculative_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("reasoning models")
    r.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the thinking off and apply structured outputs after it: qwen3 (Qwen3 / 3.5 / 3.6, "
                        "QwQ), deepseek_r1 (DeepSeek-R1 and its distills), generic (markers from --reasoning-markers)")
    r.add_argument("--reasoning-markers", default=None, metavar="START,END",
                   help="the generic parser's markers (default <think>,</think>); it thinks when the prompt opens them")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=["ngram", "suffix", "draft_model"])
    s.add_argument("--num-speculative-tokens", type=int, default=4)
    s.add_argument("--draft-model", default=None, help="draft checkpoint (method draft_model)")
    s.add_argument("--draft-device", default="cpu")
    s.add_argument("--draft-dtype", default="bfloat16")
    s.add_argument("--draft-threads", type=int, default=None)
    s.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the draft proposes among the first N ids of the vocabulary only (method draft_model)")
    s.add_argument("--prompt-lookup-min", type=int, default=1)
    s.add_argument("--prompt-lookup-max", type=int, default=4)
    s.add_argument("--no-adaptive", action="store_true", help="always draft K tokens")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`build_engine` keywords from the flags `add_engine_args` added."""
    kw = dict(
        dtype=args.dtype,
        device=args.device,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        memory_fraction=args.memory_fraction,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        num_threads=args.threads,
        cpu_offload_experts=args.cpu_offload_experts,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        chat_template=args.chat_template,
        structured_outputs_config=args.structured_outputs_config,
        structured_mask_mode=args.structured_mask_mode,
        async_scheduling=args.async_scheduling,
        speculative_config=speculative_from_args(args),
        quantization=None if args.quantization in (None, "auto", "gguf") else args.quantization,
        reasoning_parser=reasoning_from_args(args),
    )
    kw.update(dict(args.engine_arg))
    return kw


def reasoning_from_args(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """`build_engine`'s reasoning_parser from --reasoning-parser / --reasoning-markers."""
    name, markers = getattr(args, "reasoning_parser", None), getattr(args, "reasoning_markers", None)
    if markers is None:
        return name
    start, sep, end = markers.partition(",")
    if not sep or not end:
        raise SystemExit(f"--reasoning-markers must be START,END, got {markers!r}")
    return {"name": name or "generic", "start": start, "end": end}


def speculative_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.speculative_method:
        return None
    return {
        "method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "model": args.draft_model,
        "draft_device": args.draft_device,
        "draft_dtype": args.draft_dtype,
        "draft_threads": args.draft_threads,
        "draft_vocab_size": args.draft_vocab_size,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "adaptive": not args.no_adaptive,
    }
