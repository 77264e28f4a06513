"""Checkpoint loading: an HF folder (safetensors), a GGUF file, or a llama2.c `.bin`, into HF-named tensors.

Every format ends as a `Checkpoint` (models/checkpoint.py): a `ModelConfig`, a `WeightStore` of HF parameter names
(tensors read from the file when the model takes them: dense in the requested dtype, or kept quantized), and a folder
`AutoTokenizer.from_pretrained` can read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.models.checkpoint import Checkpoint, check_quantization
from tandem.models.gguf_loader import load_gguf_checkpoint
from tandem.models.hf_loader import load_hf_checkpoint
from tandem.models.llama2c import load_llama2c_checkpoint


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, *, progress: bool = True, quantization: str | None = None
) -> Checkpoint:
    """Load an HF folder, a `.gguf` (or a folder holding exactly one and no config.json) or a llama2.c `.bin`.

    `quantization`: None / "auto" keeps a GGUF's quantized blocks as stored (other formats dense), "none" makes every
    weight dense in `dtype`, "int8" quantizes dense matrices to per-channel int8 as they are read.
    """
    quant = check_quantization(quantization)
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
        return load_hf_checkpoint(p, dtype, progress=progress, quantization=quant)
    if p.suffix == ".gguf":
        return load_gguf_checkpoint(p, dtype, progress=progress, quantization=quant)
    if p.suffix == ".bin":
        ckpt = load_llama2c_checkpoint(p, dtype, progress=progress)
        ckpt.weights.quantization = quant
        return ckpt
    raise ConfigError(
        f"{p}: unsupported checkpoint file; give an HF folder (config.json + safetensors), a .gguf file, "
        "or a llama2.c .bin"
    )
