"""Write GGUF files as llama.cpp's converter and quantizer do, tensor by tensor (a file of any size in bounded memory).

Names and q/k row order as `convert_hf_to_gguf.py` writes them (llama permutes q/k rows to interleaved RoPE pairs),
the architecture's metadata, a tokenizer copied from another GGUF (padded with unused tokens up to the model's
vocabulary), and each tensor in a type: BF16 / F16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 with the `gguf` package's
quantizers, Q4_K and Q6_K with the ones here (min-max per sub-block, scales rounded to their 6 / 8 bits: simple, and
valid blocks; llama.cpp's own search finds slightly smaller errors), and the mixes llama.cpp names Q4_K_M (its
`llama_tensor_get_type`: Q6_K for the output matrix and for attn_v / ffn_down of the layers `use_more_bits` picks,
Q4_K elsewhere, Q5_0 / Q8_0 where a row is not a multiple of 256). A mixture of experts is written as the converter
writes it: per layer one [E, rows, cols] tensor per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`,
quantized expert by expert as the arrays arrive) and the router `ffn_gate_inp` in F32 (llama.cpp never quantizes it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tandem.config import ConfigError
from tandem.models.shapes import ModelShape

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
}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # a row not a multiple of 256 (llama.cpp's choice)
_ROW_CHUNK = 1 << 22  # values quantized per numpy pass: bounds the temporaries of a large matrix


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers whose attn_v / ffn_down get more bits in a _M mix."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(file_type: str, gguf_name: str, cols: int, n_layers: int, tied: bool) -> Q:
    """The GGML type of one tensor in a file of `file_type` (1-D tensors stay F32)."""
    _, base = FILE_TYPES[file_type]
    kind = base
    if file_type == "Q4_K_M":
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
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(axis=2), 0.0)  # [B, 8] mins are <= 0: stored as positive offsets
    scale = (b.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    sc = _ratio(scale, d.astype(np.float32)[:, None], 63)
    mn = _ratio(-lo, dmin.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * sc  # [B, 8]
    off = dmin.astype(np.float32)[:, None] * mn
    q = _ratio(b + off[:, :, None], step[:, :, None], 15)  # [B, 8, 32]
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1).astype(np.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128).astype(np.uint8)  # pair p: sub-block 2p low, 2p + 1 high
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1).reshape(x.shape[0], -1)


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
    if kind == Q.Q6_K:
        return quantize_q6_k(x)
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
          "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
_PERMUTED = {"llama", "mixtral"}  # the families llama.cpp's `llama` architecture runs with interleaved RoPE pairs


def _file_form(hf_name: str, array: np.ndarray, shape: ModelShape) -> np.ndarray:
    if shape.family in _PERMUTED and ".q_proj." in hf_name:
        return permute_for_llama_cpp(array, shape.heads)
    if shape.family in _PERMUTED and ".k_proj." in hf_name:
        return permute_for_llama_cpp(array, shape.kv_heads)
    return array


def file_tensors(shape: ModelShape) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """The GGUF tensors of a shape in file order: (GGUF name, size in HF order, the HF weights it holds in order);
    an expert projection holds its E experts' matrices stacked, size (E, rows, cols)."""
    from tandem.models.shapes import weight_shapes

    arch = _ARCHS[shape.family]
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
        router = name.endswith(".ffn_gate_inp.weight")
        kind = Q.F32 if len(size) == 1 or router else tensor_type(file_type, name, size[-1], shape.layers, shape.tied)
        _add_tensor_info(writer, name, size, kind)
        plan.append((hf_names, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    it = iter(weights)
    for hf_names, kind in plan:
        parts = []
        for hf_name in hf_names:  # one matrix at a time: an expert tensor is its experts' blocks one after another
            got, array = next(it)
            if got != hf_name:
                raise ConfigError(f"weights out of order: expected {hf_name}, got {got}")
            dense = array.ndim == 1 or kind == Q.F32
            parts.append(array.astype(np.float32) if dense else quantize(_file_form(hf_name, array, shape), kind))
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
    if shape.qk_norm:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        if shape.family == "qwen3moe":
            writer.add_expert_feed_forward_length(shape.expert_intermediate)
    writer.add_file_type(FILE_TYPES[file_type][0])
    if tokenizer_gguf is not None:
        copy_tokenizer(writer, tokenizer_gguf, shape.vocab)


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path, vocab: int) -> None:
    """The `tokenizer.*` metadata of another GGUF, its token list padded with unused tokens up to `vocab`."""
    reader = gguf.GGUFReader(str(src))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens" and len(value) < vocab:
            value = list(value) + [f"<unused{i}>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type" and len(value) < vocab:
            value = list(value) + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores" and len(value) < vocab:
            value = list(value) + [0.0] * (vocab - len(value))
        writer.add_key_value(key, value, field.types[0], sub_type=sub)


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
