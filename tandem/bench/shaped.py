"""`tandem bench throughput --shape NAME --formats ...`: tandem and llama.cpp on the same model file of a named shape.

Each format's model is written once (`models/gguf_writer.py: shaped_model`; random weights, the demo tokenizer),
then tandem runs it in a fresh process (so its resident memory is its own: after load, and at the peak of the run)
and llama.cpp runs the same file, one request at a time, in another. `hf` is the bf16 safetensors folder (llama.cpp
gets the BF16 GGUF of the same weights) and `hf-int8` the same folder with `quantization="int8"` (llama.cpp: Q8_0).

Columns: tok/s, TTFT / TPOT medians, `rss_load_mib` (the process after loading, before any request), `rss_peak_mib`
(its peak over the run), `model_mib` (RSS after load minus RSS before it: what loading the model added), for tandem
`weights_mib` (as held) and `kv_mib` (the cache as planned; its pages are committed only when written), and
`matmul_frac`: the projections' arithmetic (2 x parameters x tokens, prompt and output; attention excluded) per
second of the run, over the machine's measured peak for the same kind of matmul (bf16 GEMM, or the int8 kernels).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, cast

from tandem.bench.common import RunResult, drive, machine_line, print_table
from tandem.params import SamplingParams
from tandem.runner.runner import ModelRunner

PEER_FILE = {"hf": "BF16", "hf-int8": "Q8_0"}  # llama.cpp's file for tandem's safetensors runs


def run_shapes(
    args: argparse.Namespace, engine_kw: dict[str, Any], levels: list[int], prompts: list[list[list[int]]]
) -> list[dict[str, Any]]:
    """Every format of `args.shape` at every concurrency level (`prompts[i]`: the token ids run at `levels[i]`),
    llama.cpp beside it at level 1; prints and returns the rows."""
    threads = args.threads or len(os.sched_getaffinity(0))
    peaks = measure_matmul_peak(threads)
    print(f"machine: {machine_line()}; threads {threads}; matmul peak: bf16 {peaks['bf16']:.0f} GFLOP/s, "
          f"int8 kernels {peaks['int8']:.0f} GOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    for fmt in args.formats.split(","):
        rows += run_format(args, fmt, levels, prompts, threads, peaks, engine_kw)
    return rows


def run_format(
    args: argparse.Namespace, fmt: str, levels: list[int], prompts: list[list[list[int]]], threads: int,
    peaks: dict[str, float], engine_kw: dict[str, Any],
) -> list[dict[str, Any]]:
    from tandem.bench.peers import in_subprocess, llama_cpp_available, llama_cpp_batched, llama_cpp_generate
    from tandem.models.gguf_writer import shaped_model

    path = shaped_model(args.shape, "hf" if fmt.startswith("hf") else fmt)
    kw = dict(engine_kw, quantization="int8" if fmt == "hf-int8" else engine_kw.get("quantization"))
    kw["max_num_seqs"] = max(max(levels), kw.get("max_num_seqs") or 1)
    kw["max_model_len"] = kw.get("max_model_len") or args.input_len + args.output_len + 16
    runs = in_subprocess(tandem_run, str(path), kw, levels, prompts, args.output_len)
    out: list[dict[str, Any]] = []
    peer_path = path if not fmt.startswith("hf") else shaped_model(args.shape, PEER_FILE[fmt])
    for level, prompt_set, tres in zip(levels, prompts, runs["results"]):
        kind = "bf16" if fmt in ("hf", "BF16", "F16") else "int8"
        tres.extra.update(runs["memory"])
        tres.extra["matmul_frac"] = round(matmul_rate(runs["params"], prompt_set, tres) / (peaks[kind] * 1e9), 3)
        rows = [tres]
        if "llama.cpp" in args.peers and llama_cpp_available():
            if level == 1:
                rows.append(llama_cpp_generate(peer_path, prompt_set, args.output_len, True, threads, ()))
            elif len(prompt_set) == level:  # all at once, as llama-server -np <level> serves them
                rows.append(llama_cpp_batched(peer_path, prompt_set, args.output_len, threads, f"llama.cpp -np {level}")[0])
        for r in rows:
            row = {"model": f"{args.shape} {fmt}", "concurrency": level, **r.row()}
            row["vs_tandem"] = round(tres.tok_per_s / r.tok_per_s, 2) if r.tok_per_s else None
            out.append(row)
        print_table(out[-len(rows):])
    return out


def tandem_run(
    path: str, kw: dict[str, Any], levels: list[int], prompts: list[list[list[int]]], output_len: int
) -> dict[str, Any]:
    """In a fresh process: load, measure memory, run each level (fixed lengths, greedy, EOS ignored)."""
    from tandem.engine.llm import build_engine
    from tandem.runner.memory import resident_bytes

    before, _ = resident_bytes()
    engine = build_engine(path, progress=False, **kw)
    after, load_peak = resident_bytes()
    runner = cast(ModelRunner, engine.runner)  # build_engine makes a ModelRunner
    drive(engine, [prompts[0][0][:8]], SamplingParams(max_tokens=4), 1, "warmup")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    results = [drive(engine, p, params, level, "tandem") for level, p in zip(levels, prompts)]
    _, peak = resident_bytes()
    mib = 2**20
    memory = {"rss_load_mib": round(after / mib), "rss_load_peak_mib": round(load_peak / mib),
              "rss_peak_mib": round(peak / mib), "model_mib": round((after - before) / mib),
              "weights_mib": round(runner.weight_bytes / mib), "kv_mib": round(runner.kv_cache_bytes / mib)}
    cfg = runner.model_config
    head = cfg.vocab_size * cfg.hidden_size
    engine.shutdown()
    return {"results": results, "memory": memory, "params": (runner.model.matmul_params - head, head)}


def matmul_rate(params: tuple[int, int], prompts: list[list[int]], res: RunResult) -> float:
    """Projection FLOPs per second of a run: every prompt and output token through the layers, output tokens through
    the output projection (prompts only for their last token)."""
    layers, head = params
    prompt_tokens = sum(len(p) for p in prompts)
    flops = 2 * layers * (prompt_tokens + res.output_tokens) + 2 * head * (res.output_tokens + len(prompts))
    return flops / res.wall_s if res.wall_s > 0 else 0.0


def measure_matmul_peak(threads: int, m: int = 256, k: int = 4096, n: int = 4096) -> dict[str, float]:
    """The machine's matmul peak, measured: best of several [m, k] x [k, n] products with tandem's bf16 GEMM (or
    oneDNN) and with its int8 kernels (Q4_0 weights: the cheapest to unpack), in G(FL)OP/s."""
    import torch

    from tandem.layers.linear import make_linear
    from tandem.layers.quant import QuantizedTensor
    from tandem.runner.tensor_thread import on_tensor_thread

    def best(fn: Any, x: torch.Tensor) -> float:
        fn(x)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
        return 2 * m * k * n / min(times) / 1e9

    def measure() -> dict[str, float]:
        torch.set_num_threads(threads)
        x = torch.randn(m, k).bfloat16()
        dense = make_linear(torch.randn(n, k).bfloat16() * 0.02, use_kernels=True)
        raw = torch.randint(0, 256, (n, k // 32 * 18), dtype=torch.uint8)
        raw.view(-1, 18)[:, :2] = torch.tensor([0x3C00], dtype=torch.int16).view(torch.uint8)  # fp16 1.0 scales
        q4 = make_linear(QuantizedTensor("Q4_0", (n, k), raw), use_kernels=True)
        return {"bf16": best(dense, x), "int8": best(q4, x)}

    return on_tensor_thread(measure)

