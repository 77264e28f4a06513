"""Parity of the device path against the CPU reference, at batch > 1, for the device check (`device_check.py`).

Each check runs the same inputs through the code on `device` (bf16 where the model is) and through the CPU
reference, and returns one row: name, ok, a figure of the difference. On `--device cpu` (the dry run) both sides
run on the host: the rows then prove only that the checks run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.params import SamplingParams
from tandem.runner.runner import ModelRunner
from tandem.sampling.bitmask import apply_token_bitmask_, bitmask_words, unpack_token_bitmask
from tandem.sampling.rejection import DraftRows, rejection_sample
from tandem.sampling.sampler import Sampler, SamplingRow

BATCH = 8
CPU = torch.device("cpu")


def _logits(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, vocab, generator=g) * 4).to(torch.bfloat16).float()  # [B, V], bf16 values


def _bitmask(vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (BATCH, bitmask_words(vocab)), generator=g, dtype=torch.int32)


def check_bitmask(device: torch.device, vocab: int) -> dict[str, Any]:
    """The device's fused bitmask op (Triton on CUDA) sets exactly the disallowed logits to -inf."""
    logits, mask = _logits(vocab), _bitmask(vocab)
    got = logits.to(device)
    apply_token_bitmask_(got, mask)
    want = logits.masked_fill(~unpack_token_bitmask(mask, vocab), float("-inf"))
    same = torch.equal(got.cpu(), want)
    return {"check": "bitmask", "ok": same, "detail": f"[{BATCH}, {vocab}] rows equal: {same}"}


def _rows() -> list[SamplingRow]:
    """Greedy rows with penalties and bias beside top-k / top-p rows at temperature 0 (deterministic)."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, logit_bias={5: 50.0}), SamplingParams(temperature=0.0, presence_penalty=1.0)]
    return [SamplingRow(params[i % 4], [1, 2, 3], [4, 5, i]) for i in range(BATCH)]


def check_sampler(device: torch.device, vocab: int) -> dict[str, Any]:
    """Tokens of the vectorised sampler (penalties, bias, bitmask) on the device equal the CPU's."""
    logits, mask, rows = _logits(vocab), _bitmask(vocab), _rows()
    sampler = Sampler(vocab, [0])
    want = sampler.sample(logits, rows, mask).token_ids
    got = sampler.sample(logits.to(device), rows, mask.to(device)).token_ids
    return {"check": "sampler", "ok": got == want, "detail": f"{BATCH} rows, tokens {got}"}


def check_verification(device: torch.device, vocab: int) -> dict[str, Any]:
    """Greedy rejection sampling of 3 drafts per request accepts the same prefix on the device as on the CPU."""
    k = 3
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(BATCH * (k + 1), vocab, generator=g) * 4).to(torch.bfloat16).float()
    best = logits.argmax(-1).view(BATCH, k + 1).tolist()
    drafts = [DraftRows(best[i][:k] if i % 2 == 0 else [best[i][0], (best[i][1] + 1) % vocab, 7]) for i in range(BATCH)]
    rows = [SamplingRow(SamplingParams(temperature=0.0)) for _ in range(BATCH * (k + 1))]
    sampler = Sampler(vocab, [0])
    want = [v.tokens for v in rejection_sample(sampler, logits, rows, drafts)]
    got = [v.tokens for v in rejection_sample(sampler, logits.to(device), rows, drafts)]
    return {"check": "verification", "ok": got == want, "detail": f"{BATCH} requests x {k} drafts, accepted {[len(t) - 1 for t in got]}"}


def _plans(prompt_len: int, steps: int) -> list[StepPlan]:
    """A batched prefill of BATCH requests, then `steps` decode steps of all of them (blocks of 16, 8 each)."""
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(BATCH)]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 200, (BATCH, prompt_len + steps), generator=g).tolist()
    plans = [StepPlan(0, [ScheduledRequest(str(i), ids[i][:prompt_len], 0, tables[i]) for i in range(BATCH)])]
    for s in range(steps):
        pos = prompt_len + s
        plans.append(StepPlan(s + 1, [ScheduledRequest(str(i), [ids[i][pos]], pos, tables[i]) for i in range(BATCH)]))
    return plans


def check_model(
    config: ModelConfig, weights: Callable[[torch.device, torch.dtype], dict[str, torch.Tensor]],
    device: torch.device, dtype: torch.dtype,
) -> dict[str, Any]:
    """Logits of a batched prefill and 3 batched decode steps: the runner on `device` in `dtype` (its decode
    attention, CUDA graphs where on) against the CPU's float32 runner on the same weights."""
    cache, sched = CacheConfig(block_size=16, num_blocks=8 * BATCH + 1), SchedulerConfig(max_num_seqs=BATCH, max_model_len=128)
    # one host thread: the model is tiny, and a team of threads on a busy host waits for its descheduled members
    cpu = ModelRunner(config, weights(CPU, torch.float32), torch.float32, CPU, cache, sched, num_threads=1, use_kernels=False)
    dev = ModelRunner(config, weights(device, dtype), dtype, device, cache, sched, num_threads=1, use_kernels=False)
    worst, greedy_same, rows = 0.0, 0, 0
    for plan in _plans(prompt_len=24, steps=3):
        want = cpu.execute(plan)
        got = dev.execute(plan).float().cpu()
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        greedy_same += int((got.argmax(-1) == want.argmax(-1)).sum())
        rows += want.shape[0]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return {"check": f"model logits ({str(dtype).removeprefix('torch.')})", "ok": worst < tol,
            "detail": f"max |diff| / max |logit| {worst:.2e} (tol {tol:g}), greedy same {greedy_same}/{rows}"}


def run_parity(
    device: torch.device, vocab: int, config: ModelConfig,
    weights: Callable[[torch.device, torch.dtype], dict[str, torch.Tensor]], dtype: torch.dtype,
) -> list[dict[str, Any]]:
    """Every check; one that raises is a failed row with the error, and the others still run."""
    checks: list[Callable[[], dict[str, Any]]] = [
        lambda: check_bitmask(device, vocab), lambda: check_sampler(device, vocab),
        lambda: check_verification(device, vocab), lambda: check_model(config, weights, device, dtype),
    ]
    out = []
    for name, fn in zip(("bitmask", "sampler", "verification", "model logits"), checks):
        try:
            out.append(fn())
        except Exception as e:  # a failed check is a result, not the end of the run
            out.append({"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}"[:300]})
    return out
