"""HF checkpoint folders: `config.json` + (sharded) safetensors, read tensor by tensor. Pickle checkpoints
(`pytorch_model.bin`) are never loaded: unpickling can run arbitrary code.

The safetensors header (8 bytes of length, then JSON: name -> dtype, shape, byte range) is parsed here and each tensor
is read with a plain read when the model asks for it (`SafetensorsWeights`), so no file mapping keeps its pages in the
process and no dict holds every tensor at once. A gpt-oss weight stored as MXFP4 (`W_blocks` + `W_scales`,
`models/mxfp4.py`) is served under its plain name `W`, dequantized to the load dtype when read, and expert by expert
under `split_expert_names` (each expert's gate / up / down rows and biases, read at the expert's own byte range) as
`QuantizedTensor("MXFP4")`: the model takes these, so the experts stay in their blocks for the quantized kernels (and
are dequantized by `make_linear` where the kernels are unavailable).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ConfigError, ModelConfig
from tandem.layers.quant import QuantizedTensor
from tandem.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    Checkpoint,
    WeightStore,
    expected_weight_names,
    expert_bias_name,
    read_at,
    read_chat_template,
    split_expert_names,
)
from tandem.models.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4, ggml_rows

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass(frozen=True)
class _ExpertPart:
    """One expert's share of stacked gpt-oss tensors stored expert after expert ([E, ...]): slab `expert` of each
    source, its rows start::step (gate and up rows alternate in gate_up)."""

    sources: tuple[_Entry, ...]  # (blocks, scales) of an MXFP4 weight, or (bias,)
    expert: int
    start: int
    step: int


# a stacked gpt-oss weight -> the split projections it holds: (index in split_expert_names, first row, row step)
_EXPERT_SPLITS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "gate_up_proj": ((0, 0, 2), (1, 1, 2)),  # rows gate0, up0, gate1, ...
    "down_proj": ((2, 0, 1),),
}


class SafetensorsWeights(WeightStore):
    """The tensors of one or more safetensors files, each read when asked for and converted to `dtype`."""

    def __init__(self, files: list[Path], dtype: torch.dtype, wanted: set[str] | None = None, quantization: str = "auto") -> None:
        self.dtype = dtype
        self.quantization = quantization
        self._entries: dict[str, _Entry] = {}
        packed: dict[str, _Entry] = {}  # MXFP4 parts, by their own names
        for file in files:
            for name, entry in read_safetensors_header(file).items():
                if wanted is None or name in wanted:
                    self._entries[name] = entry
                elif name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)):
                    packed[name] = entry
        self._mxfp4: dict[str, tuple[_Entry, _Entry]] = {}  # plain name -> (blocks, scales)
        for name in list(packed):
            base = name.removesuffix(BLOCKS_SUFFIX)
            if name.endswith(BLOCKS_SUFFIX) and base + SCALES_SUFFIX in packed and (wanted is None or base in wanted):
                self._mxfp4[base] = (packed[name], packed[base + SCALES_SUFFIX])
        self._experts = mxfp4_expert_parts(self._mxfp4, self._entries)

    def names(self) -> list[str]:
        return list(self._entries) + [n for n in self._mxfp4 if n not in self._entries] + list(self._experts)

    def read(self, name: str) -> torch.Tensor | QuantizedTensor:
        if name in self._experts:
            return _read_expert(self._experts[name])
        if name not in self._entries and name in self._mxfp4:
            blocks, scales = (_read_entry(e) for e in self._mxfp4[name])
            return dequantize_mxfp4(blocks, scales, self.dtype)
        return _read_entry(self._entries[name])


def mxfp4_expert_parts(mxfp4: Mapping[str, tuple[_Entry, _Entry]], entries: Mapping[str, _Entry]) -> dict[str, _ExpertPart]:
    """`split_expert_names` -> where each expert's rows are, for every stacked MXFP4 expert weight
    ("model.layers.L.mlp.experts.gate_up_proj" / "...down_proj") and its stacked bias ("..._bias")."""
    out: dict[str, _ExpertPart] = {}
    for base, (blocks, scales) in mxfp4.items():
        parts = base.split(".")
        splits = _EXPERT_SPLITS.get(parts[-1]) if parts[-2:-1] == ["experts"] and parts[1] == "layers" else None
        if splits is None:
            continue
        bias = entries.get(base + "_bias")
        for e in range(blocks.shape[0]):
            names = split_expert_names(int(parts[2]), e)
            for index, start, step in splits:
                out[names[index]] = _ExpertPart((blocks, scales), e, start, step)
                if bias is not None:
                    out[expert_bias_name(names[index])] = _ExpertPart((bias,), e, start, step)
    return out


def _read_expert(part: _ExpertPart) -> torch.Tensor | QuantizedTensor:
    """An expert's rows: an MXFP4 weight [rows, K] as GGUF MXFP4 blocks, or its bias [rows]."""
    slabs = [_read_slab(e, part.expert)[part.start :: part.step] for e in part.sources]
    if len(slabs) == 1:
        return slabs[0].contiguous()
    blocks, scales = slabs  # [rows, K / 32, 16], [rows, K / 32]
    rows, groups = scales.shape
    return QuantizedTensor("MXFP4", (rows, groups * 32), ggml_rows(blocks.contiguous(), scales.contiguous()))


def _read_slab(e: _Entry, index: int) -> torch.Tensor:
    """e[index] of a tensor stored [n, ...], read alone."""
    size = e.nbytes // e.shape[0]
    return read_at(e.file, e.offset + index * size, size).view(e.dtype).reshape(e.shape[1:])


def _read_entry(e: _Entry) -> torch.Tensor:
    return read_at(e.file, e.offset, e.nbytes).view(e.dtype).reshape(e.shape)


def read_safetensors_header(file: Path) -> dict[str, _Entry]:
    """name -> where its bytes are; ConfigError for a file that is not safetensors (corrupt or truncated)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from e
    base = 8 + length
    out: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{file}: bad safetensors entry for {name!r}: {info!r}") from e
        if base + end > size or end - begin != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
            raise ConfigError(f"{file} is not a readable safetensors file (corrupt or truncated?): {name} is out of range")
        out[name] = _Entry(file, dtype, shape, base + begin, end - begin)
    return out


def load_hf_checkpoint(
    folder: Path, dtype: torch.dtype, *, progress: bool = True, quantization: str = "auto"
) -> Checkpoint:
    """Read `config.json` and the (possibly sharded) safetensors headers of an HF folder; check that no weight is
    missing. The tensors are read later, one at a time, as the model takes them."""
    del progress  # nothing slow happens here any more: the model's build reads (and reports) the tensors
    config = ModelConfig.from_json_file(folder / "config.json")
    expected = expected_weight_names(config)
    weights = SafetensorsWeights(safetensors_files(folder), dtype, set(expected), quantization)
    present = set(weights.names())
    missing = [n for n in expected if n not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConfigError(
            f"{folder}: {len(missing)} weight(s) missing for a {config.family} model with "
            f"{config.num_layers} layers: {shown}"
        )
    return Checkpoint(config, weights, folder, read_chat_template(folder), "hf")


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index names, or `model.safetensors`."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        shards = [folder / s for s in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise ConfigError(f"{index} names shard {shard.name}, which is missing from {folder}")
        return shards
    single = folder / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = (
        f" (found {', '.join(pickles[:3])}: .bin/pickle checkpoints are not loaded, for safety)"
        if pickles
        else ""
    )
    raise ConfigError(
        f"{folder} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}; convert the weights to safetensors "
        "(.bin/pickle checkpoints are never loaded because unpickling can run code)"
    )
