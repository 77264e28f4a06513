"""Decode attention read from the paged cache with FlexAttention (the CUDA path) against the gathered torch path:
the same outputs on a mixed step (prefills beside decodes and verifications, shared prefix blocks, a sliding window),
the metadata it reads, and the dispatch. On the CPU FlexAttention runs eagerly; the CUDA test compiles it."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers import ops as ops_mod
from tandem.layers.attention import build_metadata, paged_attention, write_kv
from tandem.layers.paged_decode import flex_available

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")

BS, H, KVH, D, NB = 4, 4, 2, 16, 24


def _step() -> StepPlan:
    """Two decodes sharing a prefix block, a verification of 3 drafts, a fresh prefill and a prefill chunk."""
    return StepPlan(0, [
        ScheduledRequest("a", [1], 9, [5, 7, 2]),  # decode at position 9 (blocks 5, 7, 2)
        ScheduledRequest("p", [1] * 6, 0, [10, 11]),  # prefill from scratch
        ScheduledRequest("b", [1], 5, [5, 3]),  # decode at 5, shares block 5 with "a"
        ScheduledRequest("v", [1] * 4, 6, [8, 9, 12]),  # verification: 1 + 3 drafts at 6..9
        ScheduledRequest("c", [1] * 3, 4, [13, 14]),  # a chunk after 4 cached tokens (q=3 joins the decode group)
    ])


def _step_16() -> StepPlan:
    """The same mix with blocks of 16 (the compiled CUDA kernels take blocks of at least 16 keys)."""
    return StepPlan(0, [
        ScheduledRequest("a", [1], 37, [5, 7, 2]),
        ScheduledRequest("p", [1] * 6, 0, [10]),
        ScheduledRequest("b", [1], 21, [5, 3]),
        ScheduledRequest("v", [1] * 4, 26, [8, 9]),
        ScheduledRequest("c", [1] * 3, 16, [13, 14]),
    ])


def _attention(
    plan: StepPlan, paged: bool, dtype: torch.dtype, device: str, window: int | None, bs: int = BS
) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    cache = (torch.randn(2, KVH, NB, bs, D, generator=g) / 2).to(device=device, dtype=dtype)
    meta = build_metadata(plan, bs, torch.device(device), gathered_decode=not paged, paged_decode=paged)
    T = meta.num_tokens
    q = torch.randn(T, H, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(T, KVH, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(T, KVH, D, generator=g).to(device=device, dtype=dtype)
    write_kv(cache, k, v, meta.slot_mapping)
    return paged_attention(q, k, v, cache, meta, scale=D**-0.5, window=window)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("bs", [BS, 16])
def test_paged_decode_matches_the_gathered_path(window: int | None, bs: int) -> None:
    plan = _step() if bs == BS else _step_16()
    want = _attention(plan, paged=False, dtype=torch.float32, device="cpu", window=window, bs=bs)
    got = _attention(plan, paged=True, dtype=torch.float32, device="cpu", window=window, bs=bs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_decode_step_matches() -> None:
    plan = StepPlan(0, [ScheduledRequest(str(i), [1], 3 + 2 * i, [i, 10 + i, 20 - i]) for i in range(3)])
    want = _attention(plan, paged=False, dtype=torch.float32, device="cpu", window=None)
    got = _attention(plan, paged=True, dtype=torch.float32, device="cpu", window=None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_metadata_lists_physical_blocks_and_builds_no_key_gather() -> None:
    meta = build_metadata(_step(), BS, torch.device("cpu"), gathered_decode=False, paged_decode=True)
    g = meta.decode
    assert g is not None and g.paged is not None
    assert g.key_blocks.numel() == 0 and g.bias.numel() == 0  # neither the padded key gather nor the float mask
    p = g.paged
    assert p.num_blocks.tolist() == [3, 2, 3, 2]  # a, b, v, c
    assert p.block_tables.tolist() == [[5, 7, 2], [5, 3, 3], [8, 9, 12], [13, 14, 14]]
    assert p.query_pos.tolist() == [[9, 9, 9, 9], [5, 5, 5, 5], [6, 7, 8, 9], [4, 5, 6, 6]]
    mask = p.block_mask(NB, None)
    assert mask.kv_num_blocks.view(-1).tolist() == [3, 2, 3, 2]
    assert mask.kv_indices[1, 0, 0, :2].tolist() == [5, 3]
    assert p.block_mask(NB, None) is mask  # built once per step and window, shared by the layers


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("TANDEM_DECODE_ATTENTION", raising=False)
    assert ops_mod.use_paged_decode(cuda) and not ops_mod.use_paged_decode(cpu)
    monkeypatch.setenv("TANDEM_DECODE_ATTENTION", "gather")
    assert not ops_mod.use_paged_decode(cuda)
    monkeypatch.setenv("TANDEM_DECODE_ATTENTION", "paged")
    assert ops_mod.use_paged_decode(cpu)
    monkeypatch.setattr(ops_mod, "flex_available", lambda: False)
    assert not ops_mod.use_paged_decode(cuda)
    cos = sin = torch.zeros(8, 4)
    monkeypatch.setenv("TANDEM_DECODE_ATTENTION", "auto")
    t = ops_mod.select_ops(cpu, cos, sin, torch.float32, use_kernels=False)
    assert isinstance(t, ops_mod.TorchOps) and t.gathered_decode and not t.paged_decode
    paged = ops_mod.TorchOps(cos, sin, torch.float32, paged_decode=True)  # as select_ops makes it on CUDA
    assert paged.paged_decode and not paged.gathered_decode
    paged.use_gathered_decode()  # what a CUDA runner with blocks under 16 keys does
    assert paged.gathered_decode and not paged.paged_decode


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 3])
def test_cuda_bf16_paged_decode_matches_the_gathered_path(window: int | None) -> None:
    plan = _step_16()
    want = _attention(plan, paged=False, dtype=torch.bfloat16, device="cuda", window=window, bs=16).float()
    got = _attention(plan, paged=True, dtype=torch.bfloat16, device="cuda", window=window, bs=16).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(os.environ.get("TANDEM_COMPILE_TESTS") != "1", reason="compiles FlexAttention (~80 s on 2 cores): TANDEM_COMPILE_TESTS=1")
@pytest.mark.parametrize("window", [None, 3])
def test_compiled_paged_decode_traces_and_matches(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block mask and mask function through torch.compile (inductor's CPU FlexAttention), compiled from a worker
    thread as the tensor thread does: what the CUDA path compiles, checked without a device."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.nn.attention.flex_attention import flex_attention

    from tandem.layers import paged_decode

    monkeypatch.setitem(paged_decode._COMPILED, "cpu", torch.compile(flex_attention))
    plan = _step()
    want = _attention(plan, paged=False, dtype=torch.float32, device="cpu", window=window)
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(_attention, plan, True, torch.float32, "cpu", window).result()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
