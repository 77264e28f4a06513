"""MXFP4 expert weights as gpt-oss checkpoints store them: kept in their blocks for tandem's kernels, or dequantized.

A stacked weight `W` [E, a, b] (the parameter transformers multiplies as x @ W[e]) is stored as
`W_blocks` uint8 [E, b, a / 32, 16] and `W_scales` uint8 [E, b, a / 32]: row r of the transposed weight [E, b, a] in
groups of 32 values, each group 16 bytes of FP4 (E2M1) codes, the even element in the low nibble and the odd one in the
high nibble, and one E8M0 scale byte s, the group's values multiplied by 2^(s - 127) (transformers' `integrations/
mxfp4.py`, `convert_moe_packed_tensors`).

Row r of expert e is then a row of an [N, K] projection weight (N = b outputs, K = a inputs) in 32-blocks: the same
block as GGUF's MXFP4 (`layers/quant.py`) with its nibbles in another order, so `ggml_rows` moves nibbles and nothing
else (llama.cpp's converter does the same), and the safetensors reader serves each expert as a `QuantizedTensor`
("MXFP4") that the quantized kernels run as stored. `dequantize_mxfp4` is the dense reference (transformers' values).
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"

# E2M1 code -> value (sign bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [E, b, G, 16] uint8, scales [E, b, G] uint8 -> W [E, G * 32, b] in `dtype` (values and power-of-two
    scales exact in bf16 and float32, as transformers computes them)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] must be uint8 of matching shapes, got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, nbytes = blocks.shape
    out = torch.empty(*prefix, groups, nbytes * 2, dtype=dtype)  # [E, b, G, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, scales.to(torch.int32).sub_(127).unsqueeze(-1), out=out)
    return out.view(*prefix, groups * nbytes * 2).transpose(1, 2).contiguous()  # [E, a, b]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, a, b] (a a multiple of 32) -> (blocks [E, b, a / 32, 16], scales [E, b, a / 32]): per group of 32 the
    smallest power-of-two scale that puts its largest magnitude within FP4's 6, each value rounded to the nearest
    code (writing test checkpoints; `dequantize_mxfp4` inverts it up to that rounding)."""
    E, a, b = w.shape
    if a % 32:
        raise ValueError(f"MXFP4 groups 32 values along dim 1, got {a}")
    rows = w.transpose(1, 2).float().reshape(E, b, a // 32, 32)
    amax = rows.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [E, b, G]
    scaled = rows / torch.exp2(exp).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # [E, b, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of MXFP4 as gpt-oss stores them -> the same rows as GGUF MXFP4 bytes, losslessly: blocks [R, G, 16] and
    scales [R, G] uint8 -> [R, G * 17], each block its scale byte, then byte j holding value j in the low nibble and
    value j + 16 in the high one. The codes index the same E2M1 values on both sides (ggml doubles its table and halves
    the scale), so only the nibbles move."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 rows need uint8 blocks [R, G, 16] and scales [R, G], got {tuple(blocks.shape)} / "
                         f"{tuple(scales.shape)}")
    rows, groups = scales.shape
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(rows, groups, 32)  # codes in element order
    qs = values[..., :16] | (values[..., 16:] << 4)  # [R, G, 16]
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(rows, groups * 17)
