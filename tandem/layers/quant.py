"""Quantized weights kept as stored: GGUF block formats and per-channel int8, dequantized with torch ops anywhere.

A `QuantizedTensor` is a weight [N, K] in the bytes a GGUF file holds (row-major, K / block blocks per row) or, for
`I8`, int8 values with one float32 scale per row. On a CPU with tandem's kernels the projection repacks it once for
`csrc/quant_ops.cpp` (`layers/linear.py`); elsewhere (an accelerator, no kernels) `dequantize` turns it into a dense
tensor with torch operations on the tensor's own device, so the dense copy is made where it is used.

Formats kept quantized: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 (32-blocks), Q4_K, Q5_K, Q6_K (256-blocks; what Q4_K_M
files mix, with Q5_0 / Q8_0 where a row is not a multiple of 256), I8. Other GGUF types are dequantized by the loader.
MXFP4 (ggml type 39; gpt-oss's experts) is a block of 32 FP4 (E2M1) codes under one E8M0 scale byte e: 1 byte e, then
16 bytes of codes, value j in the low nibble of byte j and value j + 16 in its high nibble (Q4_0's order); a code
indexes ggml's doubled E2M1 table `MXFP4_VALUES`, and the scale is 2^(e - 128) (half of 2^(e - 127), undoing the
doubling), exact in float32 for every e (e < 2: subnormal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """One block format: k values per block, bytes per block of one row, and its id in `csrc/quant_ops.cpp`."""

    name: str
    block: int
    block_bytes: int
    kernel_id: int


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("Q8_0", 32, 34, 0),
        QuantFormat("Q4_0", 32, 18, 1),
        QuantFormat("Q4_1", 32, 20, 2),
        QuantFormat("Q5_0", 32, 22, 3),
        QuantFormat("Q5_1", 32, 24, 4),
        QuantFormat("Q4_K", 256, 144, 5),
        QuantFormat("Q5_K", 256, 176, 6),
        QuantFormat("Q6_K", 256, 210, 7),
        QuantFormat("I8", 1, 1, 8),
        QuantFormat("MXFP4", 32, 17, 9),
    )
}


@dataclass
class QuantizedTensor:
    """A weight [N, K] as stored. `data`: uint8 [N, K / block * block_bytes] GGUF bytes, or int8 [N, K] for I8 with
    `scales` float32 [N] (w = q * scale)."""

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.qtype)
        if fmt is None:
            raise ValueError(f"unsupported quantized format {self.qtype!r}; supported: {sorted(FORMATS)}")
        n, k = self.shape
        if k % fmt.block:
            raise ValueError(f"{self.qtype}: K={k} is not a multiple of its block of {fmt.block}")
        if tuple(self.data.shape) != (n, k // fmt.block * fmt.block_bytes):
            raise ValueError(f"{self.qtype} [{n}, {k}]: data has shape {tuple(self.data.shape)}")
        if self.qtype == "I8" and (self.scales is None or self.scales.numel() != n):
            raise ValueError("I8 needs float32 scales [N]")

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.qtype]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def to(self, device: torch.device | str) -> QuantizedTensor:
        scales = None if self.scales is None else self.scales.to(device)
        return QuantizedTensor(self.qtype, self.shape, self.data.to(device), scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K] in `dtype`, computed with torch ops on the data's device."""
        n, k = self.shape
        if self.qtype == "I8":
            assert self.scales is not None
            return (self.data.float() * self.scales.float()[:, None]).to(dtype)
        blocks = self.data.reshape(n * (k // self.format.block), self.format.block_bytes)
        return _DEQUANTIZERS[self.qtype](blocks).reshape(n, k).to(dtype)


def concat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights of one format and K along N (fused q/k/v, gate/up); rows of a block format are independent."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("concat_rows needs parts of one format and one K")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts if p.scales is not None])
    return QuantizedTensor(
        first.qtype, (sum(p.shape[0] for p in parts), first.shape[1]), torch.cat([p.data for p in parts]), scales
    )


def quantize_int8(weight: torch.Tensor, chunk_elems: int = 1 << 24) -> QuantizedTensor:
    """Symmetric per-row (per output channel) int8: scale = max |w| / 127, q = round(w / scale). Row chunks of
    ~`chunk_elems` bound the float32 temporaries (a 128k-vocabulary embedding would otherwise take 2 GB)."""
    n, k = int(weight.shape[0]), int(weight.shape[1])
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, chunk_elems // max(k, 1))
    for r in range(0, n, step):
        w = weight[r : r + step].float()  # [rows, K]
        s = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        q[r : r + step] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[r : r + step] = s
    return QuantizedTensor("I8", (n, k), q, scales)


# ---- dequantizers: blocks [B, block_bytes] uint8 (GGUF layout) -> float32 [B, block] ----


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per value (little-endian fp16) [B, 2 * n] -> float32 [B, n]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32]: the 16 low nibbles, then the 16 high ones (32-block order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n / 8] bytes -> [B, n] bits, little-endian within each byte."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], n)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    """5-bit quants of Q5_0 / Q5_1: 4 bytes of high bits at `off`, then the nibbles."""
    return (_nibbles(b[:, off + 4 :]) | (_bits(b[:, off : off + 4], 32) << 4)).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4) + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K 12-byte scale fields [B, 12] -> 6-bit scales and mins [B, 8] (llama.cpp get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_quants(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 256] nibbles: per 32 bytes, 32 low nibbles then 32 high ones (sub-blocks 2p, 2p + 1)."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 256)


def _k_dequant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc)[:, :, None]  # [B, 8, 1]
    m = (_f16(b[:, 2:4]) * mn)[:, :, None]
    return (d * q.float().reshape(-1, 8, 32) - m).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_dequant(b, _k_quants(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    high = _bits(b[:, 16:48], 256).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, 256)  # bit j of byte i -> j * 32 + i
    return _k_dequant(b, _k_quants(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 128)  # [B, half, 128]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(-1, 2, 128)
    q = (low | (high << 4)).reshape(-1, 16, 16).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16]
    d = _f16(b[:, 208:210])  # [B, 1]
    return ((d * scales)[:, :, None] * q).reshape(-1, 256)


MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 codes doubled (ggml's kvalues_mxfp4)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8, any shape) -> 2^(e - 128) as float32, built from its bits as ggml does
    (`ggml_e8m0_to_fp32_half`): exponent field e - 1 for e >= 2, the subnormals 2^-128 / 2^-127 below."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 >= 2, (e32 - 1) << 23, torch.bitwise_left_shift(torch.full_like(e32, 0x00200000), e32))
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return e8m0_half(b[:, :1]) * table[_nibbles(b[:, 1:]).long()]  # [B, 1] * [B, 32]: one rounding, exact


_DEQUANTIZERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "MXFP4": _mxfp4,
}
