"""The timed sections of the device check (`device_check.py`): decode rates, guided vs unguided, suffix
speculation on a copy workload, kernel launches per decode step, a mixture of experts with its experts on the host
against on the device. Each takes a built, warmed engine (or, for the experts, a builder) and returns plain figures
for the report."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.bench.common import RunResult, drive, percentile
from tandem.bench.schemas import distinct_schemas
from tandem.engine.engine import LLMEngine
from tandem.layers.moe_offload import OffloadSetting, bus_bytes
from tandem.models.shapes import ModelShape
from tandem.params import SamplingParams, StructuredOutputsParams
from tandem.runner.runner import ModelRunner
from tandem.runner.timeline import DeviceTimeline


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    shape: ModelShape
    concurrency: int
    prompt_len: int
    output_len: int
    num_schemas: int
    profile_steps: int
    moe_shape: ModelShape | None = None  # the experts-on-the-host case (None: skipped)
    moe_batch: int = 16
    moe_len: int = 32  # prompt and output tokens of each of its requests


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token ids of ordinary GPT-2 tokens (the padded ids above 50,256 never appear in a prompt)."""
    rng = random.Random(seed)
    return [[rng.randrange(300, 50000) for _ in range(length)] for _ in range(n)]


def _runner(engine: LLMEngine) -> ModelRunner:
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    return runner


def timed(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
          concurrency: int, name: str) -> tuple[RunResult, dict[str, float]]:
    """One run through the engine with the device's timeline marked (each forward's start and end)."""
    runner = _runner(engine)
    runner.timeline = DeviceTimeline(runner.device)
    try:
        res = drive(engine, prompts, params, concurrency, name)
        return res, runner.timeline.summary()
    finally:
        runner.timeline = None


def _row(res: RunResult, idle: dict[str, float]) -> dict[str, Any]:
    return {"requests": res.num_requests, "out_tokens": res.output_tokens, "tok_s": round(res.tok_per_s, 1),
            "tpot_p50_ms": round(percentile(res.tpot_s, 50) * 1e3, 2), "device_idle_fraction": idle["idle_fraction"],
            "device_idle_per_step_ms": idle["idle_per_step_ms"]}


def decode_rates(engine: LLMEngine, sizes: Sizes, bandwidth: float) -> dict[str, Any]:
    """Batch 1 (one request, 2 x output_len tokens; with CUDA graphs and without) and `concurrency` requests at
    once; batch 1's per-token time against the memory-bandwidth limit (every weight read once per token)."""
    params = SamplingParams(max_tokens=sizes.output_len * 2, ignore_eos=True, temperature=0.0)
    one, idle1 = timed(engine, random_prompts(1, sizes.prompt_len, seed=1), params, 1, "b1")
    runner = _runner(engine)
    graphed = runner.cuda_graphs
    runner.set_cuda_graphs(False)
    try:
        eager, idle_e = timed(engine, random_prompts(1, sizes.prompt_len, seed=1), params, 1, "b1-eager")
    finally:
        runner.set_cuda_graphs(True)
    params_n = SamplingParams(max_tokens=sizes.output_len, ignore_eos=True, temperature=0.0)
    many, idle_n = timed(engine, random_prompts(sizes.concurrency, sizes.prompt_len, seed=2), params_n,
                         sizes.concurrency, "bn")
    weight_bytes = runner.weight_bytes
    limit_tok_s = bandwidth / weight_bytes
    tpot = percentile(one.tpot_s, 50)
    return {
        "batch_1": {**_row(one, idle1), "bandwidth_limit_tok_s": round(limit_tok_s, 1),
                    "fraction_of_limit": round((1 / tpot) / limit_tok_s, 3) if tpot > 0 else 0.0},
        "batch_1_without_graphs": _row(eager, idle_e) if graphed else "graphs off: as batch_1",
        f"concurrent_{sizes.concurrency}": _row(many, idle_n),
        "weight_gib": round(weight_bytes / 2**30, 2), "graphs": runner.graph_stats(),
    }


def guided_vs_unguided(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """`concurrency` requests, each with its own JSON schema, against the same requests unguided; the device's idle
    share per step is what the host's grammar work costs it."""
    n = sizes.concurrency
    prompts = random_prompts(n, sizes.prompt_len, seed=3)
    schemas = distinct_schemas(sizes.num_schemas, seed=0)
    guided = [SamplingParams(max_tokens=sizes.output_len, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)])) for i in range(n)]
    plain = SamplingParams(max_tokens=sizes.output_len, ignore_eos=True, temperature=0.0)
    warm = [SamplingParams(max_tokens=2, temperature=0.0, structured_outputs=p.structured_outputs) for p in guided]
    drive(engine, prompts, warm, n, "guided-warm")  # schemas compiled (and cached) before the timed run
    g_res, g_idle = timed(engine, prompts, guided, n, "guided")
    u_res, u_idle = timed(engine, prompts, plain, n, "unguided")
    stats = engine.get_stats()
    return {"guided": _row(g_res, g_idle), "unguided": _row(u_res, u_idle), "schemas": len(schemas),
            "refused": len(g_res.refused), "grammar_exposed_s": stats.get("grammar_exposed_s")}


def copy_prompts(n: int, length: int) -> list[list[int]]:
    """A copy workload: each prompt is a random passage written out 3 times, so the continuation that repeats it
    is in the prompt (a trained model copies it; random weights loop on their own, which suffix decoding also
    catches)."""
    return [p * 3 for p in random_prompts(n, max(4, length // 3), seed=4)]


def speculation_copy(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """Suffix decoding (K=4, adaptive) against none, batch 1 and `concurrency`."""
    out: dict[str, Any] = {}
    params = SamplingParams(max_tokens=sizes.output_len, ignore_eos=True, temperature=0.0)
    for batch in (1, sizes.concurrency):
        prompts = copy_prompts(batch, sizes.prompt_len)
        for method in ("none", "suffix"):
            engine.set_speculation(None if method == "none" else {"method": "suffix", "num_speculative_tokens": 4})
            res, idle = timed(engine, prompts, params, batch, f"spec-{method}-{batch}")
            stats = engine.get_stats()
            out[f"{method}_batch_{batch}"] = {**_row(res, idle), "acceptance": stats.get("spec_acceptance_rate"),
                                              "mean_accepted_length": stats.get("spec_mean_accepted_length")}
    engine.set_speculation(None)
    return out


def kernel_launches(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """Kernels (and the host's launch calls) per decode step at `concurrency`, from the torch profiler over a few
    steady decode steps; on the host, operators per step instead."""
    from torch.profiler import ProfilerActivity, profile

    n = sizes.concurrency
    for i, p in enumerate(random_prompts(n, sizes.prompt_len, seed=5)):
        engine.add_request(f"prof-{i}", p, SamplingParams(max_tokens=sizes.profile_steps + 8, ignore_eos=True, temperature=0.0))
    for _ in range(4):  # prefill and the first decode steps, untimed
        engine.step()
    cuda = _runner(engine).device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(sizes.profile_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    steps = sizes.profile_steps
    kernels = sum(1 for e in events if cuda and str(e.device_type).endswith("CUDA"))
    launches = sum(1 for e in events if "LaunchKernel" in e.name)
    graphs = sum(1 for e in events if "GraphLaunch" in e.name)
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    return {"steps": steps, "kernels_per_step": round(kernels / steps, 1), "launch_calls_per_step": round(launches / steps, 1),
            "graph_launches_per_step": round(graphs / steps, 1), "aten_ops_per_step": round(ops / steps, 1)}


NEAR_TIE = 0.1  # nats: greedy runs of two numerically different paths may part where the device's top two are this close


def moe_host_experts(build: Callable[[OffloadSetting], LLMEngine], sizes: Sizes) -> dict[str, Any]:
    """`sizes.moe_shape` with every layer's experts on the host ("all") against all on the device: tok/s at batch 1
    and `moe_batch`, bytes over the bus per step (measured and by formula), greedy tokens compared. The two paths
    round differently (host kernels vs the device's GEMMs), so a request's tokens may part only where the device's
    own top two were within NEAR_TIE; anywhere else is an error. Each engine is built, run and dropped in turn."""
    out: dict[str, Any] = {}
    tokens: dict[str, list[Any]] = {}
    for name, setting in (("on_device", None), ("on_host", "all")):
        engine = build(setting)
        try:
            out[name], tokens[name] = _moe_runs(engine, sizes)
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    out["tokens"] = _agreement(tokens["on_device"], tokens["on_host"])
    return out


def _moe_runs(engine: LLMEngine, sizes: Sizes) -> tuple[dict[str, Any], list[Any]]:
    """Batch 1 and `moe_batch` greedy runs (top-2 logprobs kept), warmed first; their rows and the outputs."""
    runner = _runner(engine)
    meter = runner.model.expert_bus.meter
    warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    drive(engine, random_prompts(sizes.moe_batch, sizes.moe_len, seed=20), warm, sizes.moe_batch, "moe-warm")
    params = SamplingParams(max_tokens=sizes.moe_len, ignore_eos=True, temperature=0.0, logprobs=2)
    model = runner.model
    layers = len(runner.host_expert_layers) if model.expert_bus.crosses else 0  # the CPU device's hop copies nothing
    kinds = sorted({e.gate_up.kind for i in runner.host_expert_layers for e in model.layers[i].moe.experts[:1]})  # type: ignore[union-attr]
    row: dict[str, Any] = {"graphs": runner.cuda_graphs, "host_expert_gib": round(runner.host_expert_bytes / 2**30, 2),
                           "host_expert_kernels": kinds}
    outs: list[Any] = []
    for batch, seed in ((1, 21), (sizes.moe_batch, 22)):
        meter.reset()
        done: list[Any] = []
        res = drive(engine, random_prompts(batch, sizes.moe_len, seed=seed), params, batch, f"moe-{batch}",
                    on_output=done.append)  # each request's last output (tokens, logprobs)
        step = bus_bytes(batch, model.cfg.hidden_size, runner.dtype, layers)
        row[f"batch_{batch}"] = {"tok_s": round(res.tok_per_s, 1), "tpot_p50_ms": round(percentile(res.tpot_s, 50) * 1e3, 2),
                                 "bus_kib_per_decode_step": round((step["to_host"] + step["to_device"]) / 1024, 1),
                                 "bus_mib_measured": round(meter.total / 2**20, 2), "bus_copies": meter.copies,
                                 "bus_bytes_per_token_layer": meter.total // meter.rows if meter.rows else 0}
        outs += sorted(done, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
    return row, outs


def _agreement(device: list[Any], host: list[Any]) -> dict[str, Any]:
    """Requests whose greedy tokens are identical; for the others, the device's top-two gap where they part."""
    identical, gaps = 0, []
    for d, h in zip(device, host):
        a, b = d.outputs[0].token_ids, h.outputs[0].token_ids
        p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if p is None:
            identical += 1
            continue
        top = d.outputs[0].logprobs[p]
        gap = top[a[p]].logprob - top[b[p]].logprob if b[p] in top else float("inf")
        gaps.append(round(gap, 4))
    if any(g > NEAR_TIE for g in gaps):
        raise AssertionError(f"host experts' greedy tokens part from the device's away from a near tie: gaps {gaps}")
    return {"requests": len(device), "identical": identical, "parted_at_near_ties": len(gaps), "gaps": gaps}
