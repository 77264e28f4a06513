"""How long one forward takes on a named accelerator for a named model: a roofline with a fixed cost per step.

A decode or verification step reads every weight once and the KV of every position it attends to; a prefill does
the arithmetic of every token. So, for a step of `n` tokens attending to `c` KV positions in all:

    t(n, c) = fixed_s + max((weight_bytes + kv_bytes_per_token * c) / (bandwidth * bandwidth_efficiency),
                            (flops_per_token * n + attention_flops_per_context_token * c_n) / (peak_flops * compute_efficiency))

with `c_n` the attended positions summed over the step's tokens. The constants are public figures (datasheets, the
model's shape); the efficiencies and the fixed cost (launches, synchronisation, sampling) are set so that the batch-1
rate matches a measured one where there is one (docs/benchmarks.md gives each preset's sources). `SimulatedRunner`
takes such a model to time its forwards (`tandem bench simulated --device-model NAME`). Not a user-facing mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.plan import StepPlan


@dataclass(frozen=True)
class DeviceModel:
    """A step-time model for one (model, accelerator) pair; all figures in bytes, FLOPs and seconds."""

    name: str
    weight_bytes: float
    flops_per_token: float  # 2 x parameters (one multiply-add per weight per token)
    kv_bytes_per_token: float  # K and V of one position, every layer
    attention_flops_per_context_token: float  # QK^T and PV per (token, attended position): 4 x layers x q width
    bandwidth: float  # bytes / s, datasheet
    peak_flops: float  # dense FLOP / s in the weights' dtype with float32 accumulation, datasheet
    bandwidth_efficiency: float
    compute_efficiency: float
    fixed_s: float  # per step: kernel launches, synchronisation, sampling on the device
    source: str = ""

    def step_s(self, num_tokens: int, context_tokens: int, attended: int) -> float:
        """Seconds of a step running `num_tokens` tokens whose requests hold `context_tokens` KV positions in all
        (each read once), the tokens attending to `attended` positions in all."""
        memory = (self.weight_bytes + self.kv_bytes_per_token * context_tokens) / (self.bandwidth * self.bandwidth_efficiency)
        compute = (self.flops_per_token * num_tokens + self.attention_flops_per_context_token * attended) / (
            self.peak_flops * self.compute_efficiency)
        return self.fixed_s + max(memory, compute)

    def plan_s(self, plan: StepPlan) -> float:
        """`step_s` of a plan: each request reads its KV up to its last position; token i of a row attends to
        start_pos + i + 1 positions."""
        tokens = context = attended = 0
        for sr in plan.requests:
            n, end = sr.num_tokens, sr.start_pos + sr.num_tokens
            tokens += n
            context += end
            attended += n * sr.start_pos + n * (n + 1) // 2
        return self.step_s(tokens, context, attended)

    def rows_s(self, starts: np.ndarray, counts: np.ndarray) -> float:
        """`plan_s` from a plan's arrays: its rows' first positions and tokens [B] int64 (core/plan_arrays.py)."""
        attended = int((counts * starts + counts * (counts + 1) // 2).sum())
        return self.step_s(int(counts.sum()), int((starts + counts).sum()), attended)

    @property
    def batch1_tokens_per_s(self) -> float:
        """Decode rate of one request with a short context (the figure presets are checked against)."""
        return 1.0 / self.step_s(1, 128, 128)


def _llama(layers: int, hidden: int, kv_heads: int, head_dim: int, params: float, dtype_bytes: int) -> dict[str, float]:
    return {
        "weight_bytes": params * dtype_bytes,
        "flops_per_token": 2.0 * params,
        "kv_bytes_per_token": 2.0 * layers * kv_heads * head_dim * dtype_bytes,
        "attention_flops_per_context_token": 4.0 * layers * hidden,
    }


DEVICE_MODELS: dict[str, DeviceModel] = {
    # Llama-2-7B (6.74e9 parameters, 32 layers, 32 kv heads of 128) in fp16 on an RTX 4090: 1,008 GB/s and 165.2 dense
    # fp16 tensor TFLOP/s with fp32 accumulation (NVIDIA Ada whitepaper); 0.85 of the bandwidth and 1.2 ms a step
    # give 59 tok/s at batch 1, the rate the CPU-draft setup this project started from measured on that card
    "llama2-7b-rtx4090": DeviceModel(
        "llama2-7b-rtx4090", **_llama(32, 4096, 32, 128, 6.74e9, 2), bandwidth=1008e9, peak_flops=165.2e12,
        bandwidth_efficiency=0.85, compute_efficiency=0.6, fixed_s=1.2e-3,
        source="Ada whitepaper (RTX 4090: 1,008 GB/s, 165.2 TFLOP/s fp16 with fp32 accumulate); 59 tok/s batch 1 measured"),
    # Llama-3.1-8B (8.03e9 parameters, 32 layers, 8 kv heads of 128) in bf16 on an H200: 4.8 TB/s HBM3e and 989 dense
    # bf16 TFLOP/s (NVIDIA H200 datasheet); 0.8 of the bandwidth, 0.6 of the arithmetic, 0.5 ms a step
    "llama3.1-8b-h200": DeviceModel(
        "llama3.1-8b-h200", **_llama(32, 4096, 8, 128, 8.03e9, 2), bandwidth=4.8e12, peak_flops=989e12,
        bandwidth_efficiency=0.8, compute_efficiency=0.6, fixed_s=0.5e-3,
        source="NVIDIA H200 datasheet (4.8 TB/s, 989 TFLOP/s dense bf16)"),
}


def device_model(name: str) -> DeviceModel:
    """The preset `name`; ValueError naming the presets otherwise."""
    try:
        return DEVICE_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown device model {name!r}; presets: {', '.join(sorted(DEVICE_MODELS))}") from None
