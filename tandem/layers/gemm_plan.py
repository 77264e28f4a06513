"""Which unit runs this CPU's projections, AMX tiles or AVX512 (BF16 / VNNI), and how its quantized decode tiles are
shaped: measured once per CPU, cached under `$TANDEM_HOME/calibration/` (`bf16_plan` for bf16 weights, `int8_plan`
for the Q8_0 / I8 formats, `decode_tile_plan` for the K-quants' one- and two-row tiles).

Both kernels (`csrc/cpu_ops.cpp: linear_bf16`) read the same packed weight, so switching costs no memory. They are
mixed by row count only when they round alike on this CPU: a request's numbers must not depend on the batch it runs
in (tests/engine/test_engine.py::test_batch_invariance). On Sapphire Rapids they do not (the tile unit's bf16 dot products differ from
`vdpbf16ps` in the last bits, measured), so there one unit serves every row count: AMX when its one-row time is
within `BATCH1_TOLERANCE` of AVX512-BF16's (batch 1 no slower) and it is faster from `BATCH_ROWS` rows, else
AVX512-BF16. `TANDEM_BF16_GEMM=amx|avx512|auto` overrides the measurement. A CPU with neither (AVX2 / FMA only) runs
the same packed weight widened to float32 (`avx2-fma`): nothing to choose.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "TANDEM_BF16_GEMM"
BATCH1_TOLERANCE = 0.95  # AMX's one-row speed over AVX512-BF16's that still counts as "no slower" (timing noise)
BATCH_ROWS = 32  # the batched row count AMX must win at
CALIBRATION_ROWS = (1, 8, 32, 128)
# 2048 -> 2048: an 8 MiB weight, past L2, so the one-row case streams memory as a real model's decode does
CALIBRATION_SHAPE = (2048, 2048)
PLAN_VERSION = 1


@dataclass(frozen=True)
class Bf16Plan:
    """The choice, as plain data. `amx_rows` is linear_bf16's argument: calls of at least that many rows run on AMX
    (0: never, 1: every call)."""

    path: str  # "amx" | "avx512-bf16" | "amx from N rows" (only where the two round alike)
    amx_rows: int
    reason: str
    gflops: dict[str, dict[int, float]] = field(default_factory=dict)  # unit -> rows -> GFLOP/s at calibration
    same_rounding: bool = False


def bf16_plan() -> Bf16Plan:
    """This process's plan (computed or read once; the first call may take ~1 s to measure)."""
    plan = _PLAN.get("plan")
    if plan is None:
        plan = _PLAN["plan"] = _make_plan()
        logger.info("bf16 projections: %s (%s)", plan.path, plan.reason)
    return plan


_PLAN: dict[str, Bf16Plan] = {}


def _make_plan() -> Bf16Plan:
    if _gemm_isa() == 1:
        return Bf16Plan("avx2-fma", 0, "no AVX512-BF16 in this CPU or build: bf16 widened to float32 in AVX2 FMAs")
    if not _amx_available():
        return Bf16Plan("avx512-bf16", 0, "no AMX bf16 tiles in this CPU or build")
    wanted = os.environ.get(ENV, "auto").strip().lower()
    if wanted not in ("auto", "amx", "avx512", "avx512-bf16"):
        logger.warning("%s=%r is not one of auto, amx, avx512: measuring as with auto", ENV, wanted)
    if wanted == "amx":
        return Bf16Plan("amx", 1, f"{ENV}=amx")
    if wanted in ("avx512", "avx512-bf16"):
        return Bf16Plan("avx512-bf16", 0, f"{ENV}={wanted}")
    cached = _read_cached()
    if cached is not None:
        return cached
    plan = calibrate()
    _write_cached(plan)
    return plan


def calibrate(shape: tuple[int, int] = CALIBRATION_SHAPE, rows: tuple[int, ...] = CALIBRATION_ROWS) -> Bf16Plan:
    """Time both units on one weight at each row count and check whether they round alike; the plan that follows."""
    n, k = shape
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    packed = w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    gemm = torch.ops.tandem.linear_bf16
    gflops: dict[str, dict[int, float]] = {"avx512-bf16": {}, "amx": {}}
    same = True
    for m in rows:
        x = torch.randn(m, k, generator=g).bfloat16()
        same = same and torch.equal(gemm(x, packed, None, 0), gemm(x, packed, None, 1))
        avx_s, amx_s = _race([partial(gemm, x, packed, None, 0), partial(gemm, x, packed, None, 1)])
        gflops["avx512-bf16"][m] = round(2 * m * n * k / avx_s / 1e9, 2)
        gflops["amx"][m] = round(2 * m * n * k / amx_s / 1e9, 2)
    avx, amx = gflops["avx512-bf16"], gflops["amx"]
    if same:
        wins = [m for m in rows if amx[m] > avx[m]]
        first = min(m for m in wins if all(amx[r] > avx[r] for r in rows if r >= m)) if wins else 0
        path = "avx512-bf16" if not first else "amx" if first == 1 else f"amx from {first} rows"
        return Bf16Plan(path, first, "the units round alike here: each row count takes the faster", gflops, True)
    one, batched = amx[1] / avx[1], amx[BATCH_ROWS] / avx[BATCH_ROWS] if BATCH_ROWS in rows else 0.0
    if one >= BATCH1_TOLERANCE and batched > 1.0:
        return Bf16Plan("amx", 1, f"rounding differs, so one unit for all rows; AMX {one:.2f}x at 1 row, "
                        f"{batched:.2f}x at {BATCH_ROWS}", gflops)
    return Bf16Plan("avx512-bf16", 0, f"rounding differs, so one unit for all rows; AMX {one:.2f}x at 1 row, "
                    f"{batched:.2f}x at {BATCH_ROWS}", gflops)


def _race(fns: list[Callable[[], object]], budget_s: float = 0.08, min_calls: int = 12) -> list[float]:
    """Each function's fastest call, the functions called in turn (so that a burst of other work on the machine slows
    all of them alike; the minimum is the least disturbed call)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    spent, calls = 0.0, 0
    while spent < budget_s or calls < min_calls:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[i], spent = min(best[i], dt), spent + dt
        calls += 1
    return best


def _gemm_isa() -> int:
    """linear_bf16's unit in this build: 2 AVX512-BF16, 1 AVX2 / FMA, 0 none (or no kernels)."""
    from tandem.layers.kernels import load_cpu_kernels

    return int(torch.ops.tandem.bf16_gemm_isa()) if load_cpu_kernels() else 0


def _amx_available() -> bool:
    from tandem.layers.kernels import load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.tandem, "has_amx_bf16") and bool(torch.ops.tandem.has_amx_bf16())


def _cache_file(kind: str = "bf16-gemm") -> Path:
    from tandem.layers.kernels import build_key, cpu_signature
    from tandem.paths import tandem_home

    key = hashlib.sha256(f"{cpu_signature()}|{build_key()}|{torch.get_num_threads()}|{PLAN_VERSION}".encode())
    return tandem_home() / "calibration" / f"{kind}-{key.hexdigest()[:16]}.json"


def _read_cached() -> Bf16Plan | None:
    raw = _read_json(_cache_file())
    try:
        return Bf16Plan(**raw) if raw is not None else None
    except TypeError:  # a file written by another version of the plan
        return None


def _read_json(path: Path) -> dict | None:  # type: ignore[type-arg]
    """A cached plan's fields (row counts back to ints), or None when missing or unreadable."""
    try:
        raw = json.loads(path.read_text())
        for rates in ("gflops", "gbps"):  # unit -> rows -> rate, rows back to ints
            if rates in raw:
                raw[rates] = {u: {int(m): v for m, v in d.items()} for u, d in raw[rates].items()}
        return raw  # type: ignore[no-any-return]
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write_cached(plan: Bf16Plan) -> None:
    _write_json(_cache_file(), asdict(plan))


def _write_json(path: Path, data: dict[str, object]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.info("kernel plan not cached (%s)", e)


@dataclass(frozen=True)
class Int8Plan:
    """Where the signed 8-bit quantized formats (Q8_0, I8) switch from VNNI to AMX int8 tiles: `amx_rows` is
    quant_linear's argument (0: never). The two paths give the same results bit for bit (checked here before the
    plan mixes them), so the switch is by row count: from the smallest count where AMX wins at every count above."""

    amx_rows: int
    reason: str
    gflops: dict[str, dict[int, float]] = field(default_factory=dict)


INT8_ROWS = (1, 4, 8, 16, 32, 128)


def int8_plan() -> Int8Plan:
    """This process's plan for Q8_0 / I8 projections (measured once per CPU, cached beside the bf16 plan)."""
    plan = _INT8.get("plan")
    if plan is None:
        plan = _INT8["plan"] = _make_int8_plan()
        logger.info("Q8_0 / I8 projections: AMX from %s rows (%s)", plan.amx_rows or "no", plan.reason)
    return plan


_INT8: dict[str, Int8Plan] = {}


def _make_int8_plan() -> Int8Plan:
    if not _amx_int8_available():
        return Int8Plan(0, "no AMX int8 tiles in this CPU or build")
    wanted = os.environ.get(INT8_ENV, "auto").strip().lower()
    if wanted != "auto" and not wanted.isdigit():
        logger.warning("%s=%r is neither auto nor a row count: measuring as with auto", INT8_ENV, wanted)
    if wanted.isdigit():
        return Int8Plan(int(wanted), f"{INT8_ENV}={wanted}")
    path = _cache_file("int8")
    raw = _read_json(path)
    if raw is not None:
        try:
            return Int8Plan(**raw)
        except TypeError:
            pass
    plan = calibrate_int8()
    _write_json(path, asdict(plan))
    return plan


INT8_ENV = "TANDEM_INT8_AMX_ROWS"  # a row count forces that threshold (0: VNNI only)


def calibrate_int8(shape: tuple[int, int] = CALIBRATION_SHAPE, rows: tuple[int, ...] = INT8_ROWS) -> Int8Plan:
    """Q8_0 on VNNI and on AMX at each row count: equal bitwise (else never AMX), then the threshold."""
    from tandem.layers.quant import FORMATS

    n, k = shape
    packed, fmts, ns = [_random_packed("Q8_0", n, k, 1)], [FORMATS["Q8_0"].kernel_id], [n]
    op = torch.ops.tandem.quant_linear
    gflops: dict[str, dict[int, float]] = {"vnni": {}, "amx": {}}
    g = torch.Generator().manual_seed(0)
    for m in rows:
        x = torch.randn(m, k, generator=g).bfloat16()
        vnni, amx = partial(op, x, packed, fmts, ns, None, 2, 0), partial(op, x, packed, fmts, ns, None, 2, 1)
        if not torch.equal(vnni(), amx()):
            return Int8Plan(0, f"AMX and VNNI differ at {m} rows here: VNNI only", gflops)
        vnni_s, amx_s = _race([vnni, amx])
        gflops["vnni"][m] = round(2 * m * n * k / vnni_s / 1e9, 2)
        gflops["amx"][m] = round(2 * m * n * k / amx_s / 1e9, 2)
    wins = [m for m in rows if all(gflops["amx"][r] > gflops["vnni"][r] for r in rows if r >= m)]
    first = min(wins) if wins else 0
    return Int8Plan(first, "bitwise equal; AMX from the smallest row count it wins at and above" if first
                    else "bitwise equal; AMX never faster here", gflops)


def _amx_int8_available() -> bool:
    from tandem.layers.kernels import load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.tandem, "has_amx_int8") and bool(torch.ops.tandem.has_amx_int8())


@dataclass(frozen=True)
class DecodeTilePlan:
    """Whether K-quant (Q4_K / Q5_K / Q6_K) tiles of one or two rows over short rows (<= 24 KB a 16-lane group, see
    quant_ops.cpp) take one group (`narrow`: one weight stream per thread) or four (two): the kernels'
    `quant_set_narrow_kquant_tiles`. Results are the same either way;
    `gbps` is the weight read rate of each shape at calibration ("wide" / "narrow" -> rows -> GB/s)."""

    narrow: bool
    reason: str
    gbps: dict[str, dict[int, float]] = field(default_factory=dict)


TILES_ENV = "TANDEM_DECODE_TILES"  # auto | narrow | wide
TILE_ROWS = (1, 2)
NARROW_MIN_GAIN = 1.03  # narrow tiles' speed over wide ones (geometric mean over TILE_ROWS) that switches them on
TILE_SHAPE = (8192, 2048)  # Q4_K, 9.7 MB packed, rows of 19 KB a group (short); copies fill past the last-level cache
TILE_MIN_BYTES = 64 << 20


def decode_tile_plan() -> DecodeTilePlan:
    """This process's K-quant decode tile shape (measured once per CPU, cached), set in the kernels on first call."""
    plan = _TILES.get("plan")
    if plan is None:
        plan = _TILES["plan"] = _make_tile_plan()
        torch.ops.tandem.quant_set_narrow_kquant_tiles(plan.narrow)
        logger.info("K-quant decode tiles: %s (%s)", "narrow" if plan.narrow else "wide", plan.reason)
    return plan


_TILES: dict[str, DecodeTilePlan] = {}


def _make_tile_plan() -> DecodeTilePlan:
    wanted = os.environ.get(TILES_ENV, "auto").strip().lower()
    if wanted in ("narrow", "wide"):
        return DecodeTilePlan(wanted == "narrow", f"{TILES_ENV}={wanted}")
    if wanted != "auto":
        logger.warning("%s=%r is not one of auto, narrow, wide: measuring as with auto", TILES_ENV, wanted)
    path = _cache_file("decode-tiles")
    raw = _read_json(path)
    if raw is not None:
        try:
            return DecodeTilePlan(**raw)
        except TypeError:  # a file written by another version of the plan
            pass
    plan = calibrate_decode_tiles()
    _write_json(path, asdict(plan))
    return plan


def calibrate_decode_tiles(shape: tuple[int, int] = TILE_SHAPE, min_bytes: int = TILE_MIN_BYTES) -> DecodeTilePlan:
    """Both tile shapes on copies of one Q4_K weight that together stream from DRAM (past the last-level cache), as a
    real model's decode reads its weights, at each of TILE_ROWS; narrow where it wins by NARROW_MIN_GAIN. Leaves the
    kernels' setting as it found it."""
    from tandem.layers.quant import FORMATS

    n, k = shape
    fmt = FORMATS["Q4_K"]
    first = _random_packed("Q4_K", n, k, 2)  # d, dmin
    count = math.ceil(max(min_bytes, 2 * _last_level_cache()) / first.nbytes)
    copies = [first] + [first.clone() for _ in range(count - 1)]
    op, nbytes = torch.ops.tandem.quant_linear, first.nbytes * len(copies)
    before = torch.ops.tandem.quant_set_narrow_kquant_tiles(False)
    gbps: dict[str, dict[int, float]] = {"wide": {}, "narrow": {}}
    try:
        for m in TILE_ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))

            def stream(narrow: bool, x: torch.Tensor = x) -> None:
                torch.ops.tandem.quant_set_narrow_kquant_tiles(narrow)
                for w in copies:
                    op(x, [w], [fmt.kernel_id], [n], None, 2, 0)

            wide_s, narrow_s = _race([partial(stream, False), partial(stream, True)], budget_s=0.2, min_calls=6)
            gbps["wide"][m], gbps["narrow"][m] = round(nbytes / wide_s / 1e9, 2), round(nbytes / narrow_s / 1e9, 2)
    finally:
        torch.ops.tandem.quant_set_narrow_kquant_tiles(before)
    gains = [gbps["narrow"][m] / gbps["wide"][m] for m in TILE_ROWS]
    gain = math.prod(gains) ** (1 / len(gains))
    return DecodeTilePlan(gain >= NARROW_MIN_GAIN, f"narrow tiles {gain:.2f}x wide ones streaming "
                          f"{nbytes >> 20} MiB of Q4_K at {', '.join(map(str, TILE_ROWS))} rows", gbps)


def _last_level_cache() -> int:
    """Bytes of CPU 0's largest cache as Linux reports it (sysfs); 0 where it does not."""
    sizes = [0]
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes)


def _random_packed(qtype: str, n: int, k: int, scales: int) -> torch.Tensor:
    """A packed [n, k] weight of random blocks whose first `scales` fp16 fields (d, dmin) are 0.01 (finite, so no
    inf / nan in the sums): what the calibrations time, their speed does not depend on the values."""
    import numpy as np

    from tandem.layers.quant import FORMATS

    fmt = FORMATS[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(n, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    raw[..., : 2 * scales] = np.full((*raw.shape[:2], scales), 0.01, dtype=np.float16).view(np.uint8)
    return torch.ops.tandem.quant_pack(torch.from_numpy(raw.reshape(n, -1)), fmt.kernel_id, n, k)  # type: ignore[no-any-return]
