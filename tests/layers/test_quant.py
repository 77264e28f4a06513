"""Quantized weights: torch dequantizers against gguf's, and every CPU kernel (both ISAs) against
dequantize-then-matmul in float64 / float32, on small random blocks that exercise every bit of each format."""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
import pytest
import torch

from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import GroupedProjections, QuantProjection, make_linear, quant_isa
from tandem.layers.quant import FORMATS, QuantizedTensor, concat_rows, e8m0_half, quantize_int8

GGUF_FORMATS = [f for f in FORMATS if f != "I8"]
# the fp16 fields of each block (d, and m / dmin): random bytes there would make inf / nan scales
_SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
                  "Q6_K": [208], "MXFP4": []}
_E8M0_OFFSETS = {"MXFP4": 0}  # the E8M0 scale byte of each block: random bytes there reach 2^127 (inf weights)

needs_kernels = pytest.mark.skipif(not load_cpu_kernels() or quant_isa() == 0, reason="no quantized CPU kernels here")


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantizedTensor:
    """Random GGUF blocks (every quant bit pattern possible) with sane fp16 scales."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        halves = rng.uniform(0.002, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., off : off + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype in _E8M0_OFFSETS:  # 2^-10 .. 2^-3 (halved: the codes are doubled), as the fp16 scales above
        raw[..., _E8M0_OFFSETS[qtype]] = rng.integers(118, 126, size=raw.shape[:2], dtype=np.uint8)
    return QuantizedTensor(qtype, (n, k), torch.from_numpy(raw.reshape(n, -1)))


def quantized_activations(x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's activation quantization, as the kernels do it: (dequantized x [M, K] float64, d per block, s).

    32-blocks (Q8_0 / Q8_1): d = amax / 127 kept as fp16, q = rint(x * 127 / amax), s = fp16(d * sum q);
    256-blocks (Q8_K): iscale = -127 / (value of largest magnitude), q = min(127, rint(iscale * x)), d = 1 / iscale.
    """
    xb = x.float().numpy().reshape(x.shape[0], -1, block)
    if block == 32:
        amax = np.abs(xb).max(axis=2, keepdims=True)
        d = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.rint(xb * inv)
        d16 = d.astype(np.float16).astype(np.float32)
        s = (d * q.sum(axis=2, keepdims=True).astype(np.float32)).astype(np.float16).astype(np.float64)
        return (q * d16).reshape(x.shape).astype(np.float64), d16, s
    idx = np.abs(xb).argmax(axis=2)[..., None]
    mx = np.take_along_axis(xb, idx, axis=2)
    iscale = np.float32(-127) / mx
    q = np.minimum(127, np.rint(iscale * xb))
    return (q * (np.float32(1) / iscale)).reshape(x.shape).astype(np.float64), 1 / iscale, np.zeros(0)


def reference(w: QuantizedTensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Exact y = W x' over the quantized activations x' (float64), and a bound |W| |x'| on each entry's terms."""
    block = 256 if w.qtype in ("Q4_K", "Q5_K", "Q6_K") else 32
    xq, _, s = quantized_activations(x, block)
    wd = w.dequantize(torch.float64).numpy() if w.qtype == "I8" else w.dequantize().double().numpy()
    if w.qtype in ("Q4_1", "Q5_1"):  # the min term uses llama.cpp's s = fp16(d * sum q), not sum(x')
        m = _f16_field(w, 2)  # [N, blocks]
        wd_no_min = wd - np.repeat(m, 32, axis=1)
        y = xq @ wd_no_min.T + s[:, :, 0] @ m.T
    else:
        y = xq @ wd.T
    return y, np.abs(xq) @ np.abs(wd).T


def _f16_field(w: QuantizedTensor, off: int) -> np.ndarray:
    blocks = w.data.numpy().reshape(w.shape[0], -1, w.format.block_bytes)
    return blocks[..., off : off + 2].copy().view(np.float16)[..., 0].astype(np.float64)


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
def test_torch_dequantize_matches_gguf(qtype: str) -> None:
    w = random_blocks(qtype, 5, 512)
    want = gguf.quants.dequantize(w.data.numpy(), getattr(gguf.GGMLQuantizationType, qtype)).reshape(5, 512)
    assert np.array_equal(w.dequantize().numpy(), want)


def test_int8_quantizer_round_trip() -> None:
    w = torch.randn(40, 96) * torch.linspace(0.01, 3, 40)[:, None]
    q = quantize_int8(w, chunk_elems=96 * 7)  # several row chunks
    assert q.data.dtype == torch.int8 and int(q.data.abs().max()) == 127
    err = (q.dequantize() - w).abs() / q.scales[:, None]  # type: ignore[index]
    assert float(err.max()) <= 0.5 + 1e-4  # at most half a step per row


@needs_kernels
@pytest.mark.parametrize("qtype", GGUF_FORMATS)
def test_packed_rows_are_the_dequantized_weight(qtype: str) -> None:
    w = random_blocks(qtype, 37, 512)  # 37 rows: a partial 16-row group
    proj = make_linear(w, use_kernels=True)
    assert isinstance(proj, QuantProjection)
    ids = torch.tensor([0, 36, 5, 16, 17, 36])
    assert torch.equal(proj.rows(ids), w.dequantize()[ids])


@needs_kernels
@pytest.mark.parametrize("qtype", [*GGUF_FORMATS, "I8"])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_kernel_matches_dequantize_then_matmul(qtype: str, isa: str) -> None:
    isa_id = {"avx2": 1, "avx512": 2}[isa]
    if isa_id > quant_isa():
        pytest.skip(f"no {isa} on this CPU")
    n, k = 53, 512  # 4 groups of 16 rows (one partial)
    w = quantize_int8(torch.randn(n, k)) if qtype == "I8" else random_blocks(qtype, n, k, seed=len(qtype))
    x = torch.randn(9, k) * torch.linspace(0.1, 4, k)  # uneven magnitudes: blocks get different scales
    x[3, :64] = 0.0  # an all-zero activation block
    proj = QuantProjection([w], None, isa_id)
    y = proj(x).double().numpy()
    want, bound = reference(w, x)
    assert np.all(np.abs(y - want) <= 2e-6 * bound + 1e-9), np.abs(y - want).max()
    # and against the float32 weights and activations themselves: within the activation rounding
    dense = x @ w.dequantize().T
    torch.testing.assert_close(torch.from_numpy(y).float(), dense, rtol=0, atol=float(0.02 * dense.abs().max()))
    for m in (1, 2, 3, 5):  # a row's result does not depend on the rows computed with it
        assert np.array_equal(proj(x[:m].contiguous()).double().numpy(), y[:m])


_LARGEST_CODE = {"Q8_0": 0x7F, "MXFP4": 0x77}  # a byte whose every quant is the format's largest; 0xFF elsewhere


@needs_kernels
@pytest.mark.parametrize("qtype", GGUF_FORMATS)
def test_kernel_on_saturated_blocks_matches_the_reference(qtype: str) -> None:
    """Every quant (and K-quant scale) at its largest code against activations all at -127 or 127: the largest
    integer sums the kernels form. AVX2 adds products as int16 over several chunks before widening them (llama.cpp's
    pair sums), so a bound taken too loose would wrap here."""
    fmt = FORMATS[qtype]
    n, k = 32, 512
    raw = np.full((n, k // fmt.block, fmt.block_bytes), _LARGEST_CODE.get(qtype, 0xFF), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        raw[..., off : off + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype in _E8M0_OFFSETS:
        raw[..., _E8M0_OFFSETS[qtype]] = 120
    w = QuantizedTensor(qtype, (n, k), torch.from_numpy(raw.reshape(n, -1)))
    for isa in range(1, quant_isa() + 1):
        proj = QuantProjection([w], None, isa)
        for x in (torch.ones(5, k), -torch.ones(5, k), torch.ones(5, k) * torch.tensor([1.0, -1.0]).repeat(k // 2)):
            want, bound = reference(w, x)
            y = proj(x).double().numpy()
            assert np.all(np.abs(y - want) <= 2e-6 * bound + 1e-9), (isa, np.abs(y - want).max())
            assert np.array_equal(proj(x[:2].contiguous()).double().numpy(), y[:2])  # decode tiles (AVX2: packed codes)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_1", "MXFP4"])
def test_avx2_and_avx512_agree_to_the_bit(qtype: str) -> None:
    if quant_isa() < 2:
        pytest.skip("needs AVX512-VNNI to compare with")
    w = random_blocks(qtype, 32, 768 if qtype.endswith("K") else 96)
    x = torch.randn(6, w.shape[1]).bfloat16()
    a, b = QuantProjection([w], None, 1)(x), QuantProjection([w], None, 2)(x)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def mxfp4_extreme_blocks(n: int, k: int, exponents: Sequence[int], seed: int = 0) -> QuantizedTensor:
    """MXFP4 blocks [n, k] with every code and scale bytes drawn from `exponents` (the E8M0 edges: the subnormal
    scales 0 and 1, the first normal 2, 127 (1.0), and large ones)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.choice(np.asarray(exponents, dtype=np.uint8), size=raw.shape[:2])
    return QuantizedTensor("MXFP4", (n, k), torch.from_numpy(raw.reshape(n, -1)))


def test_mxfp4_scales_are_exact_for_every_exponent() -> None:
    """2^(e - 128) for all 256 scale bytes, from its bits: equal to the float64 power (subnormals included) and to
    gguf's dequantizer on blocks of each byte (inf where 12 x 2^(e - 128) overflows float32, as there)."""
    e = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(e8m0_half(e).double(), torch.exp2(e.double() - 128))
    w = mxfp4_extreme_blocks(256, 64, range(256))
    w.data.view(256, 2, 17)[:, :, 0] = e[:, None]  # row r: both blocks under scale byte r
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(256, 64)
    assert np.isinf(want).any() and np.array_equal(w.dequantize().numpy(), want)


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_mxfp4_kernel_at_extreme_scales(isa: str) -> None:
    """Subnormal and huge block scales mixed in one row: the kernel's rows are dequantize()'s bit for bit (inf
    included) and its products the exact reference's; the two ISAs agree to the bit."""
    isa_id = {"avx2": 1, "avx512": 2}[isa]
    if isa_id > quant_isa():
        pytest.skip(f"no {isa} on this CPU")
    rows = mxfp4_extreme_blocks(48, 256, [0, 1, 2, 3, 100, 127, 128, 200, 254, 255], seed=1)
    proj = QuantProjection([rows], None, isa_id)
    assert torch.equal(proj.rows(torch.arange(48)), rows.dequantize())
    w = mxfp4_extreme_blocks(53, 512, [0, 1, 2, 3, 64, 120, 127, 128, 140, 190], seed=2)  # products stay finite
    x = torch.randn(5, 512) * torch.linspace(0.1, 4, 512)
    y = QuantProjection([w], None, isa_id)(x).double().numpy()
    want, bound = reference(w, x)
    assert np.all(np.isfinite(y)) and np.all(np.abs(y - want) <= 2e-6 * bound + 1e-30), np.abs(y - want).max()
    if quant_isa() == 2:
        assert torch.equal(QuantProjection([w], None, 1)(x), QuantProjection([w], None, 2)(x))


def _amx_int8_or_skip() -> None:
    if not (load_cpu_kernels() and quant_isa() == 2 and torch.ops.tandem.has_amx_int8()):
        pytest.skip("the AMX int8 path needs amx_tile / amx_int8 (and a kernel build for them), which this CPU lacks")


@pytest.mark.parametrize("qtype", ["Q8_0", "I8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_amx_int8_equals_vnni_to_the_bit(qtype: str, dtype: torch.dtype) -> None:
    """Q8_0 / I8 on AMX tiles: the VNNI path's outputs bit for bit (so the two may be mixed by row count), at row
    tails of both 16-row halves, an odd count of 16-lane groups, a partial last group and a bias; a fused projection
    whose other part (Q4_K) stays on VNNI."""
    _amx_int8_or_skip()
    n, k = 72, 320  # 4.5 lane groups; 10 blocks of 32
    w = quantize_int8((torch.randn(n, k) * 0.05).bfloat16()) if qtype == "I8" else random_blocks(qtype, n, k, 4)
    bias = torch.randn(n)
    f = QuantProjection([w], bias, 2)
    x = torch.randn(70, k).to(dtype)
    for m in (1, 3, 16, 17, 31, 32, 33, 64, 70):
        xm = x[:m].contiguous()
        amx = torch.ops.tandem.quant_linear(xm, f.packed, f.formats, f.ns, f.bias, 2, 1)
        vnni = torch.ops.tandem.quant_linear(xm, f.packed, f.formats, f.ns, f.bias, 2, 0)
        assert amx.dtype == dtype and torch.equal(amx, vnni), m
    fused = make_linear([random_blocks("Q4_K", 32, 512, 5), random_blocks("Q8_0", 48, 512, 6)], use_kernels=True)
    assert isinstance(fused, QuantProjection)
    xf = torch.randn(40, 512).bfloat16()
    assert torch.equal(torch.ops.tandem.quant_linear(xf, fused.packed, fused.formats, fused.ns, None, 2, 1),
                       torch.ops.tandem.quant_linear(xf, fused.packed, fused.formats, fused.ns, None, 2, 0))


def test_int8_plan_only_mixes_bitwise_equal_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.layers import gemm_plan

    _amx_int8_or_skip()
    plan = gemm_plan.calibrate_int8(shape=(256, 512), rows=(1, 32))
    assert plan.amx_rows in (0, 1, 32) and set(plan.gflops) == {"vnni", "amx"}
    monkeypatch.setattr(gemm_plan, "_INT8", {})
    monkeypatch.setenv(gemm_plan.INT8_ENV, "8")
    assert gemm_plan.int8_plan().amx_rows == 8


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_narrow_kquant_tiles_equal_wide_ones(qtype: str) -> None:
    """The decode tile shape is a speed choice only: one lane group per one- or two-row tile gives the wide tiles'
    bits, through quant_linear (a partial last group, a bias) and quant_grouped (experts' rows apart), float32 and
    bf16, on every row count that reaches the decode tiles (1, 2, and 5 = a 4-row tile + 1)."""
    if quant_isa() < 2:
        pytest.skip("the tile shape is an AVX512 choice (AVX2 tiles are one group already)")
    _narrow_equals_wide(qtype, 512)
    _narrow_equals_wide(qtype, 4096)  # rows past the narrow tiles' bound: wide either way


def _narrow_equals_wide(qtype: str, k: int) -> None:
    proj = QuantProjection([random_blocks(qtype, 150, k, 7)], torch.randn(150), 2)
    experts = [QuantProjection([random_blocks(qtype, 80, k, s)], None, 2) for s in (8, 9, 10)]
    before = torch.ops.tandem.quant_set_narrow_kquant_tiles(False)
    try:
        for m in (1, 2, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                wide = proj(x), _grouped(experts, x)
                torch.ops.tandem.quant_set_narrow_kquant_tiles(True)
                narrow = proj(x), _grouped(experts, x)
                torch.ops.tandem.quant_set_narrow_kquant_tiles(False)
                assert all(torch.equal(a, b) for a, b in zip(wide, narrow)), (k, m, dtype)
    finally:
        torch.ops.tandem.quant_set_narrow_kquant_tiles(before)


def _grouped(experts: Sequence[QuantProjection], x: torch.Tensor) -> torch.Tensor:
    """Each of x's rows through one expert (row i -> expert i % 3, rows grouped by expert), as a MoE layer calls."""
    order = sorted(range(x.shape[0]), key=lambda i: i % len(experts))
    counts = [sum(1 for i in order if i % len(experts) == e) for e in range(len(experts))]
    grouped = GroupedProjections(experts)
    assert grouped.segments is not None  # one quant_grouped call
    return grouped(x[order].contiguous(), list(range(len(experts))), counts)


def test_decode_tile_plan_is_measured_once_per_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The plan streams both tile shapes, sets its choice in the kernels, is cached per CPU, and yields to the env."""
    from tandem.layers import gemm_plan

    if not load_cpu_kernels() or quant_isa() < 2:
        pytest.skip("needs the AVX512 quantized kernels")
    plan = gemm_plan.calibrate_decode_tiles(shape=(256, 512), min_bytes=4 << 20)
    assert set(plan.gbps) == {"wide", "narrow"} and all(v > 0 for d in plan.gbps.values() for v in d.values())
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(gemm_plan.TILES_ENV, raising=False)
    monkeypatch.setattr(gemm_plan, "TILE_SHAPE", (256, 512))
    monkeypatch.setattr(gemm_plan, "TILE_MIN_BYTES", 4 << 20)
    before = torch.ops.tandem.quant_set_narrow_kquant_tiles(False)
    try:
        monkeypatch.setattr(gemm_plan, "_TILES", {})
        first = gemm_plan.decode_tile_plan()
        assert torch.ops.tandem.quant_set_narrow_kquant_tiles(first.narrow) == first.narrow  # set in the kernels
        assert gemm_plan._cache_file("decode-tiles").exists()
        monkeypatch.setattr(gemm_plan, "calibrate_decode_tiles", lambda *a, **k: pytest.fail("calibrated again"))
        monkeypatch.setattr(gemm_plan, "_TILES", {})
        assert gemm_plan.decode_tile_plan() == first
        for forced in ("narrow", "wide"):
            monkeypatch.setenv(gemm_plan.TILES_ENV, forced)
            monkeypatch.setattr(gemm_plan, "_TILES", {})
            assert gemm_plan.decode_tile_plan().narrow is (forced == "narrow")
            assert torch.ops.tandem.quant_set_narrow_kquant_tiles(False) is (forced == "narrow")
    finally:
        torch.ops.tandem.quant_set_narrow_kquant_tiles(before)
        gemm_plan._TILES.clear()


@needs_kernels
def test_fused_group_of_mixed_formats_with_bias() -> None:
    """q, k, v as a Q4_K_M file stores them (v in Q6_K): one call, one output, same as three projections."""
    parts = [random_blocks("Q4_K", 64, 256, 1), random_blocks("Q4_K", 32, 256, 2), random_blocks("Q6_K", 32, 256, 3)]
    bias = torch.randn(128)
    x = torch.randn(3, 256)
    fused = make_linear(parts, bias, use_kernels=True)
    assert isinstance(fused, QuantProjection) and fused.qtypes == ["Q4_K", "Q6_K"]  # adjacent Q4_K merged
    separate = torch.cat([make_linear(p, use_kernels=True)(x) for p in parts], dim=1) + bias
    torch.testing.assert_close(fused(x), separate, rtol=0, atol=1e-5)


def test_quantized_weights_without_kernels_are_dequantized() -> None:
    """The accelerator / no-kernel path: dequantized once with torch ops, then a dense projection."""
    w = random_blocks("Q4_1", 16, 64)
    proj = make_linear([w, concat_rows([w, w])], use_kernels=False, dtype=torch.float32)
    x = torch.randn(2, 64)
    torch.testing.assert_close(proj(x), x @ torch.cat([w.dequantize()] * 3).T)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", [*GGUF_FORMATS, "I8"])
def test_dequantize_on_the_device(qtype: str) -> None:
    """Accelerators: the blocks go to the device as bytes and are dequantized there with torch ops."""
    w = quantize_int8(torch.randn(32, 512)) if qtype == "I8" else random_blocks(qtype, 32, 512)
    on_device = w.to("cuda").dequantize(torch.float32)
    assert on_device.device.type == "cuda"
    assert torch.equal(on_device.cpu(), w.dequantize(torch.float32))
    proj = make_linear(w.to("cuda"), use_kernels=True, dtype=torch.bfloat16)
    assert proj.kind == "dense" and proj.weight.device.type == "cuda"  # type: ignore[attr-defined]
