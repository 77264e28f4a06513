"""Write GGUF files as llama.cpp's converter and quantizer do, tensor by tensor (a file of any size in bounded memory).

Names and q/k row order as `convert_hf_to_gguf.py` writes them (llama permutes q/k rows to interleaved RoPE pairs),
the architecture's metadata, a tokenizer copied from another GGUF (padded with unused tokens up to the model's
vocabulary), and each tensor in a type: BF16 / F16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 with the `gguf` package's
quantizers, Q4_K, Q5_K and Q6_K with the ones here (min-max per sub-block, scales rounded to their 6 / 8 bits:
simple, and valid blocks; llama.cpp's own search finds slightly smaller errors), and the mixes llama.cpp names Q4_K_M
and Q5_K_M (its `llama_tensor_get_type`: Q6_K for the output matrix and for attn_v / ffn_down of the layers
`use_more_bits` picks, Q4_K / Q5_K elsewhere, Q5_0 / Q5_1 / Q8_0 where a row is not a multiple of 256). A mixture of
experts is written as the converter writes it: per layer one [E, rows, cols] tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, quantized expert by expert as the arrays arrive) and the router `ffn_gate_inp` in F32
(llama.cpp never quantizes it).

gpt-oss (GGUF architecture `gpt-oss`, `GptOssModel` in llama.cpp's converter): its stacked HF experts (gate_up
[E, hidden, 2 I] with gate / up columns interleaved, down [E, I, hidden], their biases) become `ffn_gate_exps` /
`ffn_up_exps` [E, I, hidden] and `ffn_down_exps` [E, hidden, I] with F32 biases of the same names, the sinks
`attn_sinks.weight`, the router `ffn_gate_inp` with its bias; metadata: the sliding window (every even layer uses it:
llama.cpp's default pattern), YaRN (factor, original context, beta fast / slow), the experts' width. Its experts in
MXFP4 (`quantize_mxfp4`, llama.cpp's `quantize_row_mxfp4_ref`): file type "MXFP4" keeps every other matrix BF16 (as
the converter writes the released MXFP4 checkpoints), "MXFP4_MOE" makes them Q8_0 (llama.cpp's own MXFP4_MOE mix).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tandem.config import ConfigError
from tandem.models.shapes import YARN_BETA_FAST, YARN_BETA_SLOW, ModelShape

# file type name -> (GGUF `general.file_type`, the type of a plain matrix)
FILE_TYPES: dict[str, tuple[gguf.LlamaFileType, Q]] = {
    "BF16": (gguf.LlamaFileType.MOSTLY_BF16, Q.BF16),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, Q.F16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "Q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
    "Q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
    "Q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "Q6_K": (gguf.LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    "Q4_K_M": (gguf.LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
    "Q5_K_M": (gguf.LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
    "MXFP4": (gguf.LlamaFileType.MOSTLY_MXFP4_MOE, Q.BF16),  # experts MXFP4, the rest BF16 (the converter's gpt-oss)
    "MXFP4_MOE": (gguf.LlamaFileType.MOSTLY_MXFP4_MOE, Q.Q8_0),  # experts MXFP4, the rest Q8_0 (llama-quantize's mix)
}
_MXFP4_EXPERT_FILES = {"MXFP4", "MXFP4_MOE"}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # a row not a multiple of 256 (llama.cpp's choice)
_ROW_CHUNK = 1 << 22  # values quantized per numpy pass: bounds the temporaries of a large matrix


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers whose attn_v / ffn_down get more bits in a _M mix."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(file_type: str, gguf_name: str, cols: int, n_layers: int, tied: bool) -> Q:
    """The GGML type of one tensor in a file of `file_type` (1-D tensors stay F32)."""
    _, base = FILE_TYPES[file_type]
    kind = base
    if file_type in _MXFP4_EXPERT_FILES and "_exps." in gguf_name:
        kind = Q.MXFP4
    if file_type in ("Q4_K_M", "Q5_K_M"):
        layer = int(gguf_name.split(".")[1]) if gguf_name.startswith("blk.") else -1
        if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
            kind = Q.Q6_K if cols % 256 == 0 else Q.Q8_0
        elif (".attn_v." in gguf_name or ".ffn_down" in gguf_name) and use_more_bits(layer, n_layers):
            kind = Q.Q6_K
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if cols % block:
        kind = _FALLBACK.get(kind, Q.F16)
    return kind


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256k] float32 -> Q4_K blocks [n, k * 144] uint8: per 32 values a 6-bit scale and min of the block's."""
    d, dmin, scales, q = _k_scales_mins(x, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128).astype(np.uint8)  # pair p: sub-block 2p low, 2p + 1 high
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1).reshape(x.shape[0], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[n, 256k] float32 -> Q5_K blocks [n, k * 176] uint8: Q4_K's scales and mins with q in [0, 31], its low four
    bits packed as Q4_K's, the fifth bit of sub-block j's value l in bit j of qh[l] (llama.cpp's block_q5_K)."""
    d, dmin, scales, q = _k_scales_mins(x, 31)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128).astype(np.uint8)
    qh = ((q >> 4) << np.arange(8, dtype=np.int32)[None, :, None]).sum(axis=1).astype(np.uint8)  # [B, 32]
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs],
                          axis=1).reshape(x.shape[0], -1)


def _k_scales_mins(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The Q4_K / Q5_K layout's common part for [n, 256k] float32: per 256-block d and dmin (float16 [B]), the 12
    bytes of eight 6-bit scales and mins ([B, 12] uint8), and the values' codes in [0, top] ([B, 8, 32] int32)."""
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(axis=2), 0.0)  # [B, 8] mins are <= 0: stored as positive offsets
    scale = (b.max(axis=2) - lo) / float(top)
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    sc = _ratio(scale, d.astype(np.float32)[:, None], 63)
    mn = _ratio(-lo, dmin.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * sc  # [B, 8]
    off = dmin.astype(np.float32)[:, None] * mn
    q = _ratio(b + off[:, :, None], step[:, :, None], top)  # [B, 8, 32]
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1).astype(np.uint8)
    return d, dmin, scales, q


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256k] float32 -> Q6_K blocks [n, k * 210] uint8: per 16 values a signed 8-bit scale, q in [-32, 31]."""
    b = x.reshape(-1, 16, 16).astype(np.float32)
    idx = np.abs(b).argmax(axis=2)[..., None]
    scale = np.take_along_axis(b, idx, axis=2)[..., 0] / -32.0  # [B, 16], signed
    big = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)  # [B, 1]
    d = np.where(big != 0, big / -128.0, 0.0).astype(np.float16)
    dd = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, dd, out=np.zeros_like(scale), where=dd != 0)), -128, 127)
    step = (dd * sc)[:, :, None]
    q = np.clip(np.rint(np.divide(b, step, out=np.zeros_like(b), where=step != 0)), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 128).astype(np.uint8)  # [B, half, 128]
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [B, 2, 64]
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [B, 2, 32]
    return np.concatenate([
        ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2),
    ], axis=1).reshape(x.shape[0], -1)


MXFP4_MAGNITUDES = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)  # codes 0-7 (8-15: the same, negative)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> 2^(e - 128) float32 (ggml_e8m0_to_fp32_half: from the bits; e < 2 are subnormals)."""
    e32 = e.astype(np.uint32)
    return np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23)).astype(np.uint32).view(np.float32)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """[n, 32k] float32 -> MXFP4 blocks [n, k * 17] uint8, as llama.cpp's `quantize_row_mxfp4_ref` computes them: the
    scale byte e = floor(log2 amax) - 2 + 127 (0 for a block of zeros), each value the code of the doubled E2M1 value
    v minimising |v d - x| in float32 with d = 2^(e - 128), the first code on a tie (the smaller magnitude; +0 for
    -0). Only the two magnitudes around |x| / d can win (d is a power of two, so the errors are those of |x| / d
    scaled, and farther ones are at least d larger), so each value is two float32 errors, not sixteen."""
    b = x.reshape(-1, 32).astype(np.float32)  # [B, 32]
    mag = np.abs(b)
    amax = mag.max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)  # [B]
    d = e8m0_half(e)[:, None]  # [B, 1]
    with np.errstate(over="ignore", under="ignore"):
        low = np.clip(np.searchsorted(MXFP4_MAGNITUDES, mag / d, side="right") - 1, 0, 7)  # [B, 32]
    high = np.minimum(low + 1, 7)
    err_low = np.abs(MXFP4_MAGNITUDES[low] * d - mag)
    err_high = np.abs(MXFP4_MAGNITUDES[high] * d - mag)
    k = np.where(err_high < err_low, high, low)
    codes = (k + np.where(np.signbit(b) & (k > 0), 8, 0)).astype(np.uint8)
    qs = codes[:, :16] | (codes[:, 16:] << 4)  # value j low, j + 16 high
    return np.concatenate([e[:, None], qs], axis=1).reshape(x.shape[0], -1)


def _ratio(a: np.ndarray, b: np.ndarray, top: int) -> np.ndarray:
    """round(a / b) in [0, top] as int32, 0 where b is 0."""
    r = np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), dtype=np.float32), where=b != 0)
    return np.clip(np.rint(r), 0, top).astype(np.int32)


def quantize(x: np.ndarray, kind: Q) -> np.ndarray:
    """A 2-D float32 array in `kind`: the raw GGUF bytes (uint8 rows), or float16 / float32 values."""
    if kind == Q.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if kind == Q.F16:
        return x.astype(np.float16)
    rows = max(1, _ROW_CHUNK // max(1, x.shape[1]))
    parts = [_quantize_rows(x[r : r + rows], kind) for r in range(0, x.shape[0], rows)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _quantize_rows(x: np.ndarray, kind: Q) -> np.ndarray:
    if kind == Q.Q4_K:
        return quantize_q4_k(x)
    if kind == Q.Q5_K:
        return quantize_q5_k(x)
    if kind == Q.Q6_K:
        return quantize_q6_k(x)
    if kind == Q.MXFP4:
        return quantize_mxfp4(x)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), kind)


def gguf_tensor_name(hf_name: str, arch: gguf.MODEL_ARCH, n_layers: int) -> str:
    names = gguf.get_tensor_name_map(arch, n_layers)
    base, suffix = hf_name.rsplit(".", 1)
    mapped = names.get_name(base)
    if mapped is None:
        raise ConfigError(f"no GGUF name for {hf_name}")
    return f"{mapped}.{suffix}"


def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`: HF rotate-half rows -> interleaved RoPE pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
          "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "gpt-oss": gguf.MODEL_ARCH.GPT_OSS}
_PERMUTED = {"llama", "mixtral"}  # the families llama.cpp's `llama` architecture runs with interleaved RoPE pairs


def _file_form(hf_name: str, array: np.ndarray, shape: ModelShape) -> np.ndarray:
    if shape.family in _PERMUTED and ".q_proj." in hf_name:
        return permute_for_llama_cpp(array, shape.heads)
    if shape.family in _PERMUTED and ".k_proj." in hf_name:
        return permute_for_llama_cpp(array, shape.kv_heads)
    return array


Take = Callable[[np.ndarray], np.ndarray]


def gpt_oss_file_parts(hf_name: str, size: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Take]]:
    """What an HF gpt-oss weight becomes in the file, as the converter splits it: (the name the GGUF tensor map knows,
    its size in HF order [E, rows, cols], the array's part); the sinks take a `.weight` suffix, the rest is as named."""
    parts = hf_name.rsplit(".", 1)
    base, last = parts[0], parts[-1]
    if last == "gate_up_proj":  # [E, hidden, 2 I], columns gate0, up0, gate1, ... -> [E, I, hidden] each
        e, h, two_i = size
        return [(f"{base}.{proj}.weight", (e, two_i // 2, h), _columns(start)) for proj, start in (("gate_proj", 0), ("up_proj", 1))]
    if last == "gate_up_proj_bias":  # [E, 2 I] -> [E, I] each
        return [(f"{base}.{proj}.bias", (size[0], size[1] // 2), _every_other(start)) for proj, start in (("gate_proj", 0), ("up_proj", 1))]
    if last == "down_proj":  # [E, I, hidden] -> [E, hidden, I]
        return [(f"{base}.down_proj.weight", (size[0], size[2], size[1]), lambda a: np.ascontiguousarray(a.transpose(0, 2, 1)))]
    if last == "down_proj_bias":
        return [(f"{base}.down_proj.bias", size, lambda a: a)]
    if last == "sinks":
        return [(hf_name + ".weight", size, lambda a: a)]
    return [(hf_name, size, lambda a: a)]


def _columns(start: int) -> Take:
    """[E, hidden, 2 I] -> the columns start, start + 2, ... as [E, I, hidden] (one expert's gate or up rows)."""
    return lambda a: np.ascontiguousarray(a[:, :, start::2].transpose(0, 2, 1))


def _every_other(start: int) -> Take:
    return lambda a: np.ascontiguousarray(a[:, start::2])


def _file_weights(shape: ModelShape, weights: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The weights as the file's tensors take them: gpt-oss's split (`gpt_oss_file_parts`), the others as they are."""
    for name, array in weights:
        if shape.family != "gpt-oss":
            yield name, array
            continue
        for part, _, take in gpt_oss_file_parts(name, tuple(array.shape)):
            yield part, take(array)


def file_tensors(shape: ModelShape) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """The GGUF tensors of a shape in file order: (GGUF name, size in HF order, the HF weights it holds in order);
    an expert projection holds its E experts' matrices stacked, size (E, rows, cols). gpt-oss's experts are stacked
    in its HF weights already: each file tensor holds one part of one (`gpt_oss_file_parts`)."""
    from tandem.models.shapes import weight_shapes

    arch = _ARCHS[shape.family]
    if shape.family == "gpt-oss":
        return [(gguf_tensor_name(part, arch, shape.layers), part_size, [part])
                for hf_name, size in weight_shapes(shape) for part, part_size, _ in gpt_oss_file_parts(hf_name, size)]
    out: list[tuple[str, tuple[int, ...], list[str]]] = []
    for hf_name, size in weight_shapes(shape):
        if ".experts." not in hf_name:
            out.append((gguf_tensor_name(hf_name, arch, shape.layers), size, [hf_name]))
            continue
        base, _, proj = hf_name.rpartition(".experts.")
        stacked = gguf_tensor_name(f"{base}.experts.{proj.split('.', 1)[1]}", arch, shape.layers)
        if out and out[-1][0] == stacked:
            out[-1][2].append(hf_name)
            out[-1] = (stacked, (len(out[-1][2]), *size), out[-1][2])
        else:
            out.append((stacked, (1, *size), [hf_name]))
    return out


def write_gguf(
    path: Path, shape: ModelShape, weights: Iterable[tuple[str, np.ndarray]], file_type: str,
    tokenizer_gguf: Path | None,
) -> Path:
    """Write `weights` (HF names, float32, in `weight_shapes` order) as a GGUF of `file_type`, streaming tensors;
    the tokenizer metadata comes from `tokenizer_gguf` (none when None: tandem loads such a file, llama.cpp not)."""
    if file_type not in FILE_TYPES:
        raise ConfigError(f"unknown GGUF file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[_ARCHS[shape.family]])
    _write_metadata(writer, shape, file_type, tokenizer_gguf)
    plan: list[tuple[list[str], Q]] = []
    for name, size, hf_names in file_tensors(shape):
        # F32: vectors, the router, and every tensor not named `.weight` (gpt-oss's [E, I] expert biases), as the converter
        f32 = len(size) == 1 or name.endswith(".ffn_gate_inp.weight") or not name.endswith(".weight")
        kind = Q.F32 if f32 else tensor_type(file_type, name, size[-1], shape.layers, shape.tied)
        _add_tensor_info(writer, name, size, kind)
        plan.append((hf_names, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    it = _file_weights(shape, weights)
    for hf_names, kind in plan:
        parts = []
        for hf_name in hf_names:  # one matrix at a time: an expert tensor is its experts' blocks one after another
            got, array = next(it)
            if got != hf_name:
                raise ConfigError(f"weights out of order: expected {hf_name}, got {got}")
            dense = array.ndim == 1 or kind == Q.F32
            rows = _file_form(hf_name, array, shape)
            parts.append(array.astype(np.float32) if dense else quantize(rows.reshape(-1, rows.shape[-1]), kind))
        writer.write_tensor_data(parts[0] if len(parts) == 1 else np.concatenate(parts))
    writer.close()
    tmp.rename(path)
    return path


def _add_tensor_info(writer: gguf.GGUFWriter, name: str, size: tuple[int, ...], kind: Q) -> None:
    """F32 / F16 by their numpy dtype and shape; every other type as raw bytes [rows, bytes per row]."""
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    nbytes = math.prod(size) // block * type_size
    if kind in (Q.F32, Q.F16):
        writer.add_tensor_info(name, size, np.dtype(np.float32 if kind == Q.F32 else np.float16), nbytes)
    else:
        byte_shape = (*size[:-1], size[-1] // block * type_size)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)


def _write_metadata(writer: gguf.GGUFWriter, shape: ModelShape, file_type: str, tokenizer_gguf: Path | None) -> None:
    writer.add_name(f"tandem random {shape.name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.max_position)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    if shape.qk_norm or shape.head_dim != shape.hidden // shape.heads:  # llama.cpp's default is hidden / heads
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        if shape.family in ("qwen3moe", "gpt-oss"):
            writer.add_expert_feed_forward_length(shape.expert_intermediate)
    if shape.sliding_window:  # gpt-oss: every even layer (llama.cpp's default pattern for the architecture)
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(shape.yarn_original)
        writer.add_rope_scaling_yarn_beta_fast(YARN_BETA_FAST)
        writer.add_rope_scaling_yarn_beta_slow(YARN_BETA_SLOW)
    writer.add_file_type(FILE_TYPES[file_type][0])
    if tokenizer_gguf is not None:
        copy_tokenizer(writer, tokenizer_gguf, shape.vocab)


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path, vocab: int) -> None:
    """The `tokenizer.*` metadata of another GGUF, its token list padded with unused tokens up to `vocab`, or cut to
    its first `vocab` tokens and the merges among them (llama.cpp refuses a token list longer than the embedding:
    Mixtral's 32,000 rows against the demo tokenizer's 49,152)."""
    reader = gguf.GGUFReader(str(src))
    kept = set(reader.fields["tokenizer.ggml.tokens"].contents()[:vocab])
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores") and len(value) > vocab:
            value = value[:vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if _merge_kept(m, kept)]
        if key == "tokenizer.ggml.tokens" and len(value) < vocab:
            value = list(value) + [f"<unused{i}>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type" and len(value) < vocab:
            value = list(value) + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores" and len(value) < vocab:
            value = list(value) + [0.0] * (vocab - len(value))
        writer.add_key_value(key, value, field.types[0], sub_type=sub)


def _merge_kept(merge: str, tokens: set[str]) -> bool:
    """A BPE merge "a b" whose parts and result are all among `tokens`."""
    a, _, b = merge.partition(" ")
    return a in tokens and b in tokens and a + b in tokens


MODEL_FORMATS = ("hf", *FILE_TYPES)  # "hf": a bf16 safetensors folder; the others: one GGUF file each


def shaped_model(shape_name: str, fmt: str, seed: int = 0) -> Path:
    """The random-weight model of a named shape in `fmt`, written once under `shape_dir(shape)` and reused:
    `<shape>/hf/` (bf16 safetensors) or `<shape>/<shape>.<fmt>.gguf`. The same seed gives the same weights in every
    format (each GGUF is the bf16 model quantized)."""
    from tandem.models.demo import find_demo_gguf
    from tandem.models.shapes import get_shape, random_weights, shape_dir, write_hf_model

    shape = get_shape(shape_name)
    if fmt not in MODEL_FORMATS:
        raise ConfigError(f"unknown model format {fmt!r}; known: {', '.join(MODEL_FORMATS)}")
    folder = shape_dir(shape)
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        out = folder / "hf"
        return out if (out / "config.json").is_file() else write_hf_model(shape, out, seed)
    path = folder / f"{shape.name}.{fmt}.gguf"
    if not path.is_file():
        bf16 = ((n, a.astype(np.float32)) for n, a in _bf16_rounded(random_weights(shape, seed)))
        write_gguf(path, shape, bf16, fmt, find_demo_gguf())
    return path


def _bf16_rounded(weights: Iterable[tuple[str, np.ndarray]]) -> Iterable[tuple[str, np.ndarray]]:
    """The weights as the bf16 HF folder holds them, so every format starts from the same values."""
    import torch

    for name, array in weights:
        yield name, torch.from_numpy(array).to(torch.bfloat16).float().numpy()
