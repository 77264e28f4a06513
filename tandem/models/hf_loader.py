"""HF checkpoint folders: `config.json` + (sharded) safetensors, memory-mapped. Pickle checkpoints
(`pytorch_model.bin`) are never loaded: unpickling can run arbitrary code."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from tandem.config import ConfigError, ModelConfig
from tandem.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    Checkpoint,
    expected_weight_names,
    read_chat_template,
)


def load_hf_checkpoint(folder: Path, dtype: torch.dtype, *, progress: bool = True) -> Checkpoint:
    """Read `config.json` and the (possibly sharded) safetensors of an HF folder; check that no weight is missing."""
    config = ModelConfig.from_json_file(folder / "config.json")
    expected = expected_weight_names(config)
    wanted = set(expected)
    weights: dict[str, torch.Tensor] = {}
    files = safetensors_files(folder)
    with tqdm(total=len(wanted), desc=f"loading {folder.name}", unit="tensor", disable=not progress) as bar:
        for name, tensor in _iter_safetensors(files, wanted):
            weights[name] = tensor.to(dtype)
            bar.update(1)
    missing = [n for n in expected if n not in weights]
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


def _iter_safetensors(files: list[Path], wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every wanted name in the files (memory-mapped); buffers and extras are skipped."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles have no __iter__
                    if name in wanted:
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"{file} is not a readable safetensors file (corrupt or truncated?): {e}"
            ) from e
