"""`python -m tandem.bench.device_check --device cuda`: the one prepared run on a lent accelerator.

It needs nothing that cannot travel with the repository: the model is a random-weight checkpoint of a real shape
(Llama-3.1-8B's by default) generated on the device itself, the tokenizer is GPT-2's byte-level BPE (`.device/`,
copied there by `make device-wheels`, or ../shared/data here) padded with unused tokens up to the model's
vocabulary. It writes `device_check.md` (a short table) and `device_check.json` to the output folder ($OUT):

  parity        bitmask, sampler, verification, model logits on the device (bf16, batch 8) against the CPU's
  decode        batch-1 and N-concurrent tok/s; batch 1 against the memory-bandwidth limit (weights / bandwidth)
  guided        N concurrent with N distinct JSON schemas vs the same unguided; device idle share (CUDA events)
  speculation   suffix decoding on a copy workload vs none
  launches      kernels per decode step (torch profiler)
  moe_host_experts  a Qwen3-30B-A3B-shaped MoE (4 of its 48 layers) with every layer's experts on the host
                (`cpu_offload_experts="all"`) against all on the device: tok/s at batch 1 and 16, bytes over the bus
                per step, greedy tokens compared (parting only at near ties: the paths round differently)

`--device cpu` is the dry run (tiny sizes, the same code, part of `make test`): it proves the check still runs.
Each section that fails is reported as failed and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tandem.bench.common import drive, shared_data_dir
from tandem.bench.device_parity import run_parity
from tandem.bench.device_runs import (
    Sizes,
    decode_rates,
    guided_vs_unguided,
    kernel_launches,
    moe_host_experts,
    speculation_copy,
)
from tandem.config import ModelConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.llm import build_engine
from tandem.layers.moe_offload import OffloadSetting
from tandem.models.checkpoint import Checkpoint, TensorDict
from tandem.models.shapes import ModelShape, get_shape, weight_shapes
from tandem.params import SamplingParams

HBM_BYTES_PER_S = 4.3e12  # H200's device-to-device copy, measured (docs/benchmarks.md)
TINY = ModelShape("tiny-dry-run", "llama", 64, 128, 2, 4, 2, 50304, False, max_position=512)
TINY_MOE = ModelShape("tiny-moe-dry-run", "qwen3moe", 64, 128, 2, 4, 2, 50304, False, max_position=512, head_size=16,
                      experts=4, experts_used=2, expert_intermediate=32)
# Qwen3-30B-A3B's layers, 4 of its 48: 4.8 GB of bf16 experts to copy to the host and pack, a step's cost per layer
QWEN3_MOE_L4 = replace(get_shape("qwen3-30b-a3b-l8"), name="qwen3-30b-a3b-l4", layers=4)
MOE_KV_BYTES = 1 << 30


CUDA_SIZES = Sizes(get_shape("llama3.1-8b"), concurrency=64, prompt_len=128, output_len=128, num_schemas=64, profile_steps=5,
                   moe_shape=QWEN3_MOE_L4, moe_batch=16, moe_len=32)
CPU_SIZES = Sizes(TINY, concurrency=4, prompt_len=16, output_len=8, num_schemas=4, profile_steps=2,
                  moe_shape=TINY_MOE, moe_batch=4, moe_len=6)


def default_tokenizer() -> Path:
    """GPT-2's vocab.json + merges.txt: in .device/ (carried to the device) or ../shared/data (here)."""
    carried = Path(__file__).resolve().parents[2] / ".device" / "tokenizer"
    return carried if (carried / "vocab.json").is_file() else shared_data_dir() / "tokenizers" / "gpt2"


def padded_tokenizer(src: Path, vocab: int, dst: Path) -> Path:
    """A copy of the GPT-2 tokenizer folder `src` whose vocabulary is padded with `<unusedN>` tokens up to `vocab`
    ids (a model's larger embedding keeps its true size, and every id it can sample decodes)."""
    tokens = json.loads((src / "vocab.json").read_text())
    for i in range(len(tokens), vocab):
        tokens[f"<unused{i}>"] = i
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "vocab.json").write_text(json.dumps(tokens))
    (dst / "merges.txt").write_bytes((src / "merges.txt").read_bytes())
    return dst


def random_weights(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight of `shape` generated on `device` (N(0, 0.02) matrices, unit norms): an 8B model in seconds."""
    g = torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, size in weight_shapes(shape):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(size, device=device, dtype=torch.float32)
        else:
            out[name] = torch.randn(size, generator=g, device=device, dtype=dtype).mul_(0.02)
    return out


def random_checkpoint(shape: ModelShape, device: torch.device, dtype: torch.dtype, tokenizer: Path) -> Checkpoint:
    config = ModelConfig.from_hf(shape.hf_config())
    return Checkpoint(config, TensorDict(random_weights(shape, device, dtype), dtype), tokenizer, None, "random")


def environment(device: torch.device) -> dict[str, Any]:
    """What the run ran on: torch, the device, the optional packages, the CUDA path's choices."""
    from tandem.layers.ops import use_paged_decode
    from tandem.runner.cuda_graphs import graphs_enabled

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for name in ("triton", "xgrammar", "llguidance", "transformers"):
        try:
            env[name] = __import__(name).__dict__.get("__version__", "present")
        except ImportError as e:
            env[name] = f"missing ({e})"
    env["decode_attention"] = "flex (paged)" if use_paged_decode(device) else "sdpa (gathered)"
    env["cuda_graphs"] = graphs_enabled(device)  # and the decode attention is paged (the runner checks both)
    return env


def build(sizes: Sizes, device: torch.device, dtype: torch.dtype, tokenizer: Path) -> LLMEngine:
    ckpt = random_checkpoint(sizes.shape, device, dtype, tokenizer)
    return build_engine(
        ckpt, device=str(device), max_model_len=sizes.prompt_len * 4 + sizes.output_len * 2,
        max_num_seqs=sizes.concurrency, memory_fraction=0.5, progress=False, cpu_kernels=device.type != "cpu",
        structured_outputs_config={"backend": "xgrammar"},
    )


def moe_builder(sizes: Sizes, device: torch.device, dtype: torch.dtype, tokenizer: Path) -> Callable[[OffloadSetting], LLMEngine]:
    """Engines of `sizes.moe_shape` (random weights generated on the device) with the given `cpu_offload_experts`;
    the engine's usual CPU kernels for the host experts (off in the dry run, as for the other engines there)."""
    assert sizes.moe_shape is not None
    shape = sizes.moe_shape
    tok = padded_tokenizer(tokenizer, shape.vocab, Path(tempfile.mkdtemp(prefix="tandem-moe-tok-")))

    def build_one(setting: OffloadSetting) -> LLMEngine:
        ckpt = random_checkpoint(shape, device, dtype, tok)
        return build_engine(
            ckpt, device=str(device), max_model_len=4 * sizes.moe_len, max_num_seqs=sizes.moe_batch, progress=False,
            kv_cache_memory=MOE_KV_BYTES if device.type == "cuda" else 16 << 20, cpu_kernels=device.type != "cpu",
            cpu_offload_experts=setting,
        )

    return build_one


def warm_up(engine: LLMEngine, sizes: Sizes) -> str:
    """Compile and capture before anything is timed: one batched run at full concurrency and one of batch 1."""
    prompts = [[300 + i] * sizes.prompt_len for i in range(sizes.concurrency)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    drive(engine, prompts, params, sizes.concurrency, "warm")
    drive(engine, prompts[:1], params, 1, "warm1")
    return "done"


def section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one section into results[name]; a failure is recorded with its traceback's end and the run goes on."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(f"device_check: {name} done in {results['seconds'][name]} s", file=sys.stderr, flush=True)
    out = results.get("out")
    if out:  # what ran so far survives a run stopped at its time limit
        Path(out, "device_check.partial.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def run(device: torch.device, sizes: Sizes, dtype: torch.dtype, tokenizer: Path, out: Path) -> dict[str, Any]:
    moe = sizes.moe_shape.name if sizes.moe_shape else None
    results: dict[str, Any] = {"sizes": {**vars(sizes), "shape": sizes.shape.name, "moe_shape": moe}, "out": str(out)}
    section(results, "environment", lambda: environment(device))
    tok = padded_tokenizer(tokenizer, sizes.shape.vocab, Path(tempfile.mkdtemp(prefix="tandem-tok-")))
    parity_shape = replace(TINY, vocab=sizes.shape.vocab)
    section(results, "parity", lambda: run_parity(
        device, sizes.shape.vocab, ModelConfig.from_hf(parity_shape.hf_config()),
        lambda d, dt: random_weights(parity_shape, d, dt, seed=1), dtype))
    dense_sections(results, device, sizes, dtype, tok)
    gc.collect()  # the dense model's weights and cache are gone (its engine was local there) before the experts' engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if sizes.moe_shape is not None:  # last: what ran before is in the partial report should time run out here
        section(results, "moe_host_experts", lambda: moe_host_experts(moe_builder(sizes, device, dtype, tokenizer), sizes))
    return results


def dense_sections(results: dict[str, Any], device: torch.device, sizes: Sizes, dtype: torch.dtype, tok: Path) -> None:
    """Warm-up (with the fallback to the gathered decode and no graphs should the CUDA path fail), decode, guided,
    speculation, launches on one engine of `sizes.shape`, shut down at the end."""
    engine = build(sizes, device, dtype, tok)
    section(results, "warm_up", lambda: warm_up(engine, sizes))
    if isinstance(results["warm_up"], dict) and device.type == "cuda":  # the CUDA path failed: measure the fallback
        engine.shutdown()
        os.environ.update({"TANDEM_DECODE_ATTENTION": "gather", "TANDEM_CUDA_GRAPHS": "0"})
        results["fallback"] = "warm-up failed: the rest ran with the gathered SDPA decode and no graphs"
        engine = build(sizes, device, dtype, tok)
        section(results, "warm_up_fallback", lambda: warm_up(engine, sizes))
    try:
        section(results, "decode", lambda: decode_rates(engine, sizes, HBM_BYTES_PER_S))
        section(results, "guided", lambda: guided_vs_unguided(engine, sizes))
        section(results, "speculation", lambda: speculation_copy(engine, sizes))
        section(results, "launches", lambda: kernel_launches(engine, sizes))
    finally:
        engine.shutdown()


def verdict(results: dict[str, Any]) -> bool:
    """Every section ran and every parity check passed."""
    sections = [v for k, v in results.items() if k not in ("sizes", "seconds", "out")]
    failed = any(isinstance(v, dict) and "error" in v for v in sections)
    parity = results.get("parity")
    return not failed and isinstance(parity, list) and all(row["ok"] for row in parity)


def _cells(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cells(v)}" for k, v in value.items() if k != "traceback")
    return str(value)


def write_report(results: dict[str, Any], out: Path) -> str:
    """device_check.json (everything) and device_check.md (one row per section and parity check); returns the md."""
    results["ok"] = verdict(results)
    (out / "device_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    lines = [f"# tandem device check: {'PASS' if results['ok'] else 'FAIL'}", "", "| section | result |", "|---|---|"]
    for row in results.get("parity", []) if isinstance(results.get("parity"), list) else []:
        lines.append(f"| parity: {row['check']} | {'ok' if row['ok'] else 'FAIL'}: {row['detail']} |")
    for name, value in results.items():
        if name in ("parity", "ok", "sizes", "out"):
            continue
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()) and "error" not in value:
            lines += [f"| {name}: {k} | {_cells(v)} |" for k, v in value.items()]
        else:
            lines.append(f"| {name} | {_cells(value)} |")
    text = "\n".join(lines) + "\n"
    (out / "device_check.md").write_text(text)
    return text


@contextlib.contextmanager
def cuda_path(on_host: bool) -> Iterator[None]:
    """On the host (the dry run), the CUDA path's code for the run: paged decode attention (eager FlexAttention)
    and the graphs' bookkeeping (eager stand-in); the environment is restored after."""
    keys = ("TANDEM_DECODE_ATTENTION", "TANDEM_CUDA_GRAPHS")
    saved = {k: os.environ.get(k) for k in keys}
    if on_host:
        os.environ.update({"TANDEM_DECODE_ATTENTION": "paged", "TANDEM_CUDA_GRAPHS": "1"})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.device_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for device_check.md / .json ($OUT)")
    p.add_argument("--tokenizer", default=None, help="GPT-2 style folder (vocab.json, merges.txt)")
    p.add_argument("--shape", default=None, help="model shape (default: llama3.1-8b on CUDA, a tiny one on the CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    if args.shape:
        sizes = replace(sizes, shape=get_shape(args.shape))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with cuda_path(device.type == "cpu"):
        results = run(device, sizes, dtype, Path(args.tokenizer) if args.tokenizer else default_tokenizer(), out)
    text = write_report(results, out)
    print(text, flush=True)
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
