"""tandem's fused CPU kernels against the torch operations they replace, op by op and through a whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.attention import build_metadata, write_kv
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.ops import CpuKernelOps, TorchOps, select_ops
from tandem.models.loader import load_checkpoint
from tandem.runner.runner import ModelRunner

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="tandem CPU kernels could not be built here")

BS = 4  # block size


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ops(dtype: torch.dtype, D: int = 16, max_pos: int = 64) -> tuple[TorchOps, CpuKernelOps]:
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(0, D, 2) / D)))
    t = select_ops(torch.device("cpu"), freqs.cos(), freqs.sin(), dtype, use_kernels=False)
    k = select_ops(torch.device("cpu"), freqs.cos(), freqs.sin(), dtype, use_kernels=True)
    assert isinstance(t, TorchOps) and isinstance(k, CpuKernelOps)
    return t, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype: torch.dtype, with_delta: bool) -> None:
    t, k = _ops(dtype)
    g = _gen(1)
    x = torch.randn(5, 96, generator=g)
    delta = torch.randn(5, 96, generator=g).to(dtype) if with_delta else None
    w = torch.rand(96, generator=g) + 0.5
    x1, x2 = x.clone(), x.clone()
    want = t.add_rms_norm(x1, delta, w, 1e-5, dtype)
    got = k.add_rms_norm(x2, delta, w, 1e-5, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(x2, x1)  # the residual stream is updated in place
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 300])  # 300 rows: split across threads
def test_qk_norm_of_a_strided_qkv_view(dtype: torch.dtype, T: int) -> None:
    t, k = _ops(dtype)
    g = _gen(3)
    H, KVH, D = 4, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)  # as the forward cuts it: rows strided
    qw, kw = (torch.rand(D, generator=g) + 0.5).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)
    got, want = k.qk_norm(qk, qw, kw, 1e-6, H), t.qk_norm(qk, qw, kw, 1e-6, H)
    assert got.dtype == dtype and got.shape == (T, H + KVH, D) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype: torch.dtype) -> None:
    t, k = _ops(dtype)
    gu = torch.randn(3, 2 * 40, generator=_gen(2)).to(dtype)
    torch.testing.assert_close(k.silu_mul(gu).float(), t.silu_mul(gu).float(), atol=1e-5, rtol=1e-2)


def _plan(news: list[int], starts: list[int], blocks_per_req: int) -> StepPlan:
    reqs = [
        ScheduledRequest(str(i), [1] * n, s, list(range(i * blocks_per_req, (i + 1) * blocks_per_req)))
        for i, (n, s) in enumerate(zip(news, starts))
    ]
    return StepPlan(0, reqs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_torch(dtype: torch.dtype) -> None:
    H, KVH, D = 4, 2, 16
    t, k = _ops(dtype, D)
    plan = _plan([3, 1, 5], [0, 7, 2], 4)
    meta = build_metadata(plan, BS, torch.device("cpu"))
    T = meta.num_tokens
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=_gen(3)).to(dtype)
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)  # strided rows, as the model passes them
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    c1, c2 = torch.zeros(2, KVH, 12, BS, D), torch.zeros(2, KVH, 12, BS, D)
    want = t.rope_write_kv(qk, v, t.rope_tables(meta.positions), c1, meta, H)
    got = k.rope_write_kv(qk, v, k.rope_tables(meta.positions), c2, meta, H)
    assert got.dtype == torch.float32
    # bf16: rounded where torch rounds, bit-identical; float32: equal up to fused multiply-adds
    tol = 0.0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(CpuKernelOps.to_standard_layout(c2), c1, atol=tol, rtol=tol)
    torch.testing.assert_close(CpuKernelOps.from_standard_layout(c1), c2, atol=tol, rtol=tol)


def _dense_reference(
    qk: torch.Tensor, cache_std: torch.Tensor, plan: StepPlan, news: list[int], starts: list[int], H: int, D: int,
    window: int | None, sinks: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Plain attention per request over the keys / values its block table holds (in float32), causal and windowed by
    an explicit mask, with each head's sink logit in its softmax when given: one [n, H * D] tensor per request."""
    out, row = [], 0
    for r, n, s in zip(plan.requests, news, starts):
        slots = torch.tensor([r.block_table[p // BS] * BS + p % BS for p in range(s + n)])
        kv = cache_std.flatten(2, 3).index_select(2, slots).float()  # [2, KVH, s + n, D]
        pos = torch.arange(s, s + n)[:, None]
        keys = torch.arange(s + n)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window is not None else True)
        q = qk[row : row + n, :H].transpose(0, 1)  # [H, n, D]
        if sinks is None:
            ref = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=D**-0.5, enable_gqa=True)
        else:
            G = H // kv.shape[1]
            keys_h, values_h = kv[0].repeat_interleave(G, 0), kv[1].repeat_interleave(G, 0)  # [H, s + n, D]
            scores = (q @ keys_h.transpose(1, 2) * D**-0.5).masked_fill(~mask, float("-inf"))  # [H, n, s + n]
            column = sinks.view(H, 1, 1).expand(H, n, 1)
            ref = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ values_h
        out.append(ref.transpose(0, 1).reshape(n, H * D))
        row += n
    return out


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("H,KVH", [(4, 2), (3, 3), (6, 1), (8, 1)])
def test_paged_attention_matches_dense_causal_attention(
    H: int, KVH: int, cache_dtype: torch.dtype, window: int | None, with_sinks: bool
) -> None:
    """Mixed step: a fresh prefill, decodes and multi-token (speculative) queries with scattered blocks, against
    plain SDPA over what the cache holds; the kernels' cache in float32 and in bf16 (the model dtype it holds on a
    bf16 model); with a sliding window, requests whose first blocks fall wholly outside it; with attention sinks
    (gpt-oss), each head's sink logit in its softmax's denominator."""
    D = 16
    t, k = _ops(cache_dtype, D)
    g = _gen(4)
    news, starts = [6, 1, 4, 1, 9, 16], [0, 13, 5, 2, 20, 3]  # 16 queries x 8 heads: > 64 rows in one work item
    nb = 10
    plan = _plan(news, starts, nb)
    # scatter each request's blocks over the cache so a wrong table lookup cannot pass
    perm = torch.randperm(len(news) * nb, generator=g).tolist()
    for r in plan.requests:
        r.block_table = [perm[b] for b in r.block_table]
    meta = build_metadata(plan, BS, torch.device("cpu"))
    T = meta.num_tokens
    cache_t = torch.zeros(2, KVH, len(perm), BS, D)  # the torch operations' float32 cache
    for r, s in zip(plan.requests, starts):  # earlier tokens of every request: random keys / values at their slots
        if s:
            kv = torch.randn(2, s, KVH, D, generator=g)
            slots = torch.tensor([r.block_table[p // BS] * BS + p % BS for p in range(s)])
            write_kv(cache_t, kv[0], kv[1], slots)
    cache_k = CpuKernelOps.from_standard_layout(cache_t).to(cache_dtype)  # the kernels' cache in the model dtype
    assert k.kv_cache_dtype == cache_dtype
    k.prefill_dtype = torch.float32  # the exact check below; bf16 prefill math (AMX CPUs) is checked after it
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(cache_dtype)  # the projection's output, model dtype
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    # the runner's block-major storage [2, NB, KVH, BS, D] seen as [2, KVH, NB, BS, D]: same results to the bit
    cache_bm = torch.zeros(2, len(perm), KVH, BS, D, dtype=cache_dtype).permute(0, 2, 1, 3, 4)
    cache_bm.copy_(cache_k)
    rq_k = k.rope_write_kv(qk, v, k.rope_tables(meta.positions), cache_k, meta, H)
    rq_bm = k.rope_write_kv(qk, v, k.rope_tables(meta.positions), cache_bm, meta, H)
    assert torch.equal(rq_bm, rq_k) and torch.equal(cache_bm, cache_k)
    sinks = torch.randn(H, generator=g) * 2 if with_sinks else None
    got = k.attention(rq_k, v, cache_k, meta, H, D**-0.5, torch.float32, window, sinks)
    assert torch.equal(k.attention(rq_bm, v, cache_bm, meta, H, D**-0.5, torch.float32, window, sinks), got)
    refs = _dense_reference(rq_k, CpuKernelOps.to_standard_layout(cache_k), plan, news, starts, H, D, window, sinks)
    torch.testing.assert_close(got, torch.cat(refs), atol=1e-5, rtol=1e-4)
    if cache_dtype == torch.bfloat16:  # prefill attention in bf16 (the default over a bf16 cache on AMX CPUs)
        k.prefill_dtype = torch.bfloat16
        torch.testing.assert_close(k.attention(rq_k, v, cache_k, meta, H, D**-0.5, torch.float32, window, sinks), got,
                                   atol=3e-2, rtol=2e-2)
    if cache_dtype == torch.float32:  # and the torch path (its own float32 cache) gives the same
        rq_t = t.rope_write_kv(qk, v, t.rope_tables(meta.positions), cache_t, meta, H)
        want = t.attention(rq_t, v, cache_t, meta, H, D**-0.5, torch.float32, window, sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if with_sinks:  # the sinks changed something: every query's weights sum to less than one
        plain = torch.cat(_dense_reference(rq_k, CpuKernelOps.to_standard_layout(cache_k), plan, news, starts, H, D, window))
        assert (got - plain).abs().max() > 1e-2
    if window is not None:  # the window changed something: requests longer than it differ from plain causal
        causal = torch.cat(_dense_reference(rq_k, CpuKernelOps.to_standard_layout(cache_k), plan, news, starts, H, D, None,
                                            sinks))
        assert (got - causal).abs().max() > 1e-2


def test_paged_attention_rejects_short_block_table() -> None:
    q = torch.randn(1, 2, 8, generator=_gen(5))
    cache = torch.zeros(2, 1, 4, BS, 8)
    info = torch.tensor([[0, 1, 9]])  # 10 tokens need 3 blocks, the table holds 2
    with pytest.raises(RuntimeError, match="more blocks"):
        torch.ops.tandem.paged_attention(q, cache, info, torch.tensor([[0, 1]]), 1.0, torch.empty(1, 16))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_forward_same_with_and_without_kernels(arch: str, tmp_path: Path) -> None:
    """A random-weight model in bf16: fused kernels and torch operations give the same greedy tokens, close logits."""
    from tests.models.test_parity import _tiny

    _tiny(arch).save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(tmp_path, torch.bfloat16, progress=False)
    runners = [
        ModelRunner(ckpt.config, ckpt.weights, torch.bfloat16, "cpu", CacheConfig(num_blocks=32, block_size=BS),
                    SchedulerConfig(max_model_len=64), num_threads=1, use_kernels=use)
        for use in (False, True)
    ]
    assert [r.model.ops.name for r in runners] == ["torch", "tandem-cpu"]
    outs = []
    for r in runners:
        toks = [3, 17, 9, 28, 5, 11, 2]
        rows = [r.execute(StepPlan(0, [ScheduledRequest("a", list(toks), 0, list(range(8)))]))]
        for _ in range(12):
            toks.append(int(rows[-1][-1].argmax()))
            rows.append(r.execute(StepPlan(1, [ScheduledRequest("a", [toks[-1]], len(toks) - 1, list(range(8)))])))
        outs.append((toks, torch.cat([x[-1:] for x in rows])))
    assert outs[0][0] == outs[1][0]
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=0.02, rtol=0.02)


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_matches_float_reference_and_is_row_invariant(with_bias: bool) -> None:
    from tandem.layers.linear import _bf16_gemm_available, make_linear

    if not _bf16_gemm_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    g = _gen(6)
    w = torch.randn(112, 96, generator=g).bfloat16()  # 7 blocks of 16 columns: a partial 64-column group too
    b = torch.randn(112, generator=g).bfloat16() if with_bias else None
    f = make_linear(w, b, use_kernels=True)
    x = torch.randn(13, 96, generator=g).bfloat16()  # 3 full 4-row tiles and a 1-row tail
    y = f(x)
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 112)
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=1e-2)
    for m in (1, 2, 5):  # a row's result does not depend on how many rows run with it
        assert torch.equal(f(x[:m].contiguous()), y[:m])



def test_silu_mul_kernel_any_width_and_row_count() -> None:
    """The kernel (vectorised with masked tails on AVX-512, a scalar loop elsewhere): silu(g) * u within float32
    rounding for widths that are not multiples of 16, and each row's result the same alone as in a batch."""
    g = _gen(11)
    for rows, width in ((1, 7), (3, 1536), (9, 100)):
        gu = torch.randn(rows, 2 * width, generator=g) * 8
        gate, up = gu[:, :width].double(), gu[:, width:].double()
        out = torch.ops.tandem.silu_mul(gu)
        torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=1e-12)
        for r in range(rows):
            assert torch.equal(torch.ops.tandem.silu_mul(gu[r : r + 1].contiguous()), out[r : r + 1])
