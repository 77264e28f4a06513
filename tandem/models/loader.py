"""Checkpoint loading: an HF folder (safetensors), a GGUF file, or a llama2.c `.bin`, into HF-named tensors.

Every format ends as a `Checkpoint` (models/checkpoint.py): a `ModelConfig`, a flat dict of HF parameter names ->
tensors already in the requested dtype, and a folder `AutoTokenizer.from_pretrained` can read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.models.checkpoint import Checkpoint
from tandem.models.gguf_loader import load_gguf_checkpoint
from tandem.models.hf_loader import load_hf_checkpoint
from tandem.models.llama2c import load_llama2c_checkpoint


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, *, progress: bool = True
) -> Checkpoint:
    """Load an HF folder, a `.gguf` (or a folder holding exactly one and no config.json) or a llama2.c `.bin`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"checkpoint path {p} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
        else:
            found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
            raise ConfigError(f"{p} has no config.json (and {found}): not an HF checkpoint folder")
    if p.is_dir():
        return load_hf_checkpoint(p, dtype, progress=progress)
    if p.suffix == ".gguf":
        return load_gguf_checkpoint(p, dtype, progress=progress)
    if p.suffix == ".bin":
        return load_llama2c_checkpoint(p, dtype, progress=progress)
    raise ConfigError(
        f"{p}: unsupported checkpoint file; give an HF folder (config.json + safetensors), a .gguf file, "
        "or a llama2.c .bin"
    )
