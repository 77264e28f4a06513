"""Projections: a row's result does not depend on how many rows run with it (bf16: tandem's GEMM and oneDNN
bitwise; float32 oneDNN within rounding, its one-row kernel differs), and the row buckets that bound oneDNN's
per-shape code cache; a layer's experts grouped into one kernel call give each row what its expert alone gives it."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import (
    EXACT_ROWS,
    ROW_BUCKET,
    GroupedProjections,
    Projection,
    bucket_rows,
    make_linear,
    quant_isa,
)

ROWS = (1, 3, 8, 9, 16, 17, 33)


def test_row_buckets() -> None:
    assert [bucket_rows(m) for m in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))  # exact up to 8
    for m in range(EXACT_ROWS + 1, 200):
        b = bucket_rows(m)
        assert b % ROW_BUCKET == 0 and m <= b < m + ROW_BUCKET
    assert len({bucket_rows(m) for m in range(1, 513)}) == EXACT_ROWS + 512 // ROW_BUCKET  # few shapes


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-gemm", "onednn"])
def test_bf16_rows_are_batch_invariant(kernels: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    f = make_linear(w, use_kernels=kernels)
    if kernels and f.kind != "bf16-gemm":
        pytest.skip("tandem's bf16 GEMM needs avx512_bf16 or avx2 / fma, which this CPU lacks (the oneDNN case runs)")
    full = f(x)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, atol=0.05, rtol=1e-2)
    for m in ROWS:
        assert torch.equal(f(x[:m].contiguous()), full[:m]), m


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 576), (576, 1536)])
def test_bf16_gemm_tiles_give_every_row_count_the_same_bits(n: int, k: int) -> None:
    """tandem's bf16 GEMM (AVX512-BF16, or AVX2 / FMA widening bf16 to float32) over 1-5 blocks of 16 columns and a
    bias: each row count takes its own tiles (one row across a group's blocks, two rows over block pairs, four-row
    tiles and their tails), and every row comes out bitwise the same, within bf16 rounding of a float64 reference.
    NaN and infinity pass through as in a float32 product."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(23, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    f = make_linear(w, bias, use_kernels=True)
    if f.kind != "bf16-gemm":
        pytest.skip("tandem's bf16 GEMM needs avx512_bf16 or avx2 / fma, which this CPU lacks")
    full = f(x)
    ref = x.double() @ w.double().T + bias.double()
    assert ((full.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-3 * k**0.5).all()
    for m in range(1, 10):
        assert torch.equal(f(x[:m].contiguous()), full[:m]), m
    for rows in ([0], [5, 6], [0, 3, 7, 11]):  # a row alone, a pair, four: the same bits as in the full batch
        assert torch.equal(f(x[rows].contiguous()), full[rows]), rows
    bad = x[:2].clone()
    bad[0, 3], bad[1, 0] = float("nan"), float("inf")
    out = f(bad).float()
    assert out[0].isnan().all() and out[1].isinf().all()


def test_float32_rows_agree_within_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g), torch.randn(40, 64, generator=g)
    f = make_linear(w, use_kernels=False)
    full = f(x)
    torch.testing.assert_close(full, x @ w.T, atol=1e-5, rtol=1e-5)
    for m in ROWS:
        torch.testing.assert_close(f(x[:m].contiguous()), full[:m], atol=1e-5, rtol=1e-6)


def _amx_or_skip() -> None:
    from tandem.layers.kernels import load_cpu_kernels

    if not (load_cpu_kernels() and torch.ops.tandem.has_amx_bf16()):
        pytest.skip("the AMX path needs amx_tile / amx_bf16 (and a kernel build for them), which this CPU lacks")


@pytest.mark.parametrize("n,k", [(96, 64), (48, 96), (16, 32), (64, 576)])
def test_amx_bf16_matches_reference_and_is_batch_invariant(n: int, k: int) -> None:
    """AMX tiles over the same packed weight: row tails (1-16 and 17-32 of a 32-row block), an odd count of 16-column
    blocks, a bias; every row bitwise the same at any row count."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(70, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = make_linear(w, use_kernels=True).packed  # type: ignore[attr-defined]
    full = torch.ops.tandem.linear_bf16(x, packed, bias, 1)
    ref = x.float() @ w.float().T + bias.float()
    torch.testing.assert_close(full.float(), ref, atol=0.05 * k**0.5, rtol=1e-2)
    for m in (*ROWS, 31, 32, 48, 64, 65):
        assert torch.equal(torch.ops.tandem.linear_bf16(x[:m].contiguous(), packed, bias, 1), full[:m]), m


def test_amx_needs_whole_k_tiles_and_falls_back() -> None:
    """K not a multiple of 32 (no whole A tile) runs on AVX512-BF16 whatever amx_rows says."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 48, generator=g).bfloat16(), torch.randn(40, 48, generator=g).bfloat16()
    packed = make_linear(w, use_kernels=True).packed  # type: ignore[attr-defined]
    assert torch.equal(torch.ops.tandem.linear_bf16(x, packed, None, 1), torch.ops.tandem.linear_bf16(x, packed, None, 0))


def test_bf16_plan_never_mixes_units_that_round_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan mixes AMX and AVX512-BF16 by row count only where they agree bitwise; otherwise one unit (amx_rows 0
    or 1) serves every row count. The environment overrides the measurement."""
    from tandem.layers import gemm_plan

    _amx_or_skip()
    plan = gemm_plan.calibrate(shape=(256, 256), rows=(1, 32))
    assert set(plan.gflops) == {"avx512-bf16", "amx"} and all(v > 0 for d in plan.gflops.values() for v in d.values())
    if not plan.same_rounding:
        assert plan.amx_rows in (0, 1) and plan.path in ("amx", "avx512-bf16")
    monkeypatch.setattr(gemm_plan, "_PLAN", {})
    monkeypatch.setenv(gemm_plan.ENV, "avx512")
    assert gemm_plan.bf16_plan().amx_rows == 0
    monkeypatch.setattr(gemm_plan, "_PLAN", {})
    monkeypatch.setenv(gemm_plan.ENV, "amx")
    assert gemm_plan.bf16_plan().amx_rows == 1


def test_bf16_plan_and_machine_line_name_the_unit_this_build_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2 / FMA build (no AVX512-BF16) has one unit: the plan says `avx2-fma`, never AMX, whatever the
    environment asks, and `kernel_paths` (the benchmarks' machine line) names it."""
    from tandem.layers import gemm_plan
    from tandem.layers.linear import kernel_paths

    if not load_cpu_kernels() or int(torch.ops.tandem.bf16_gemm_isa()) != 1:
        pytest.skip("this build's bf16 GEMM is not the AVX2 / FMA one (the CPU has AVX512-BF16, or no AVX2)")
    monkeypatch.setenv(gemm_plan.ENV, "amx")
    monkeypatch.setattr(gemm_plan, "_PLAN", {})
    plan = gemm_plan.bf16_plan()
    assert (plan.path, plan.amx_rows) == ("avx2-fma", 0)
    assert "avx2-fma" in kernel_paths()["bf16"]


def test_bf16_plan_is_cached_per_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from tandem.layers import gemm_plan

    _amx_or_skip()
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(gemm_plan.ENV, raising=False)
    monkeypatch.setattr(gemm_plan, "CALIBRATION_SHAPE", (256, 256))
    monkeypatch.setattr(gemm_plan, "_PLAN", {})
    first = gemm_plan.bf16_plan()
    assert gemm_plan._cache_file().exists() and gemm_plan._read_cached() == first
    monkeypatch.setattr(gemm_plan, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    monkeypatch.setattr(gemm_plan, "_PLAN", {})
    assert gemm_plan.bf16_plan() == first


def _experts(kernels: bool, bias: bool) -> list[Projection]:
    """Six experts' fused gate / up as a Q4_K_M file holds them (gate Q4_K, up Q6_K), 2 x 32 wide, K = 256."""
    from tests.layers.test_quant import random_blocks

    return [make_linear([random_blocks("Q4_K", 32, 256, 2 * e), random_blocks("Q6_K", 32, 256, 2 * e + 1)],
                        torch.randn(64) if bias else None, use_kernels=kernels, dtype=torch.float32) for e in range(6)]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grouped_experts_equal_each_expert_alone_to_the_bit(bias: bool, dtype: torch.dtype) -> None:
    """One `quant_grouped` call over the chosen experts' rows (an unchosen expert between them, mixed formats in one
    expert, biases) gives each row what its expert alone gives it, and a row alone what it gets in the group."""
    if not (load_cpu_kernels() and quant_isa()):
        pytest.skip("no quantized CPU kernels here")
    torch.manual_seed(0)
    experts = _experts(True, bias)
    grouped = GroupedProjections(experts)
    assert grouped.segments is not None  # one kernel call
    x = torch.randn(14, 256).to(dtype)
    chosen, counts = [0, 2, 3, 5], [3, 0, 10, 1]
    y = grouped(x, chosen, counts)
    alone = torch.cat([experts[0](x[:3]), experts[3](x[3:13]), experts[5](x[13:])])
    assert y.dtype == dtype and torch.equal(y, alone)
    assert torch.equal(grouped(x[5:6], [3], [1]), y[5:6])


def test_grouped_projections_without_kernels_call_each_chosen_expert() -> None:
    torch.manual_seed(0)
    experts = _experts(False, True)
    grouped = GroupedProjections(experts)
    assert grouped.segments is None
    x = torch.randn(5, 256)
    torch.testing.assert_close(grouped(x, [1, 4], [2, 3]), torch.cat([experts[1](x[:2]), experts[4](x[2:])]), rtol=0, atol=0)
