"""Build and load the native suffix trie (`csrc/suffix_tree.cpp`, a pybind11 module with torch's headers).

Compiled once per (source, torch, Python) with the host's C++ compiler into `$TANDEM_HOME/kernels/suffix-<key>/` and
imported from there afterwards; `make setup` builds it ahead of time. When no compiler is found or the build fails,
`native_suffix_tree()` returns None with the reason logged once, and suffix decoding uses the Python trie (the same
drafts, slower per token).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

NAME = "tandem_suffix_tree"
SOURCE = Path(__file__).parent / "csrc" / "suffix_tree.cpp"
_CFLAGS = ["-O2", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def build_dir() -> Path:
    import torch

    from tandem.paths import tandem_home

    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), " ".join(_CFLAGS)):
        h.update(part.encode())
    return tandem_home() / "kernels" / f"suffix-{h.hexdigest()[:16]}"


def native_suffix_tree() -> Any | None:
    """The native `SuffixTree` class (built the first time), or None when it cannot be built here."""
    with _lock:
        if "module" not in _state:
            _state["module"], why = _build_and_load()
            if _state["module"] is None:
                logger.warning("native suffix tree unavailable (%s); suffix decoding uses the Python one", why)
        module = _state["module"]
        return None if module is None else module.SuffixTree


def _build_and_load() -> tuple[ModuleType | None, str]:
    from tandem.layers.kernels import ninja_on_path

    folder = build_dir()
    built = folder / f"{NAME}.so"
    if built.exists():  # keyed by source, torch and Python: import without asking ninja (no rebuild per checkout)
        try:
            return _import(built), ""
        except ImportError as e:
            logger.info("rebuilding the native suffix tree (%s)", e)
    try:
        from torch.utils import cpp_extension

        ninja_on_path()
        folder.mkdir(parents=True, exist_ok=True)
        logger.info("building the native suffix tree into %s (once, ~20 s)", folder)
        module = cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=_CFLAGS, build_directory=str(folder),
                                    is_python_module=True, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        text = str(e).strip()
        return None, f"build failed: {text.splitlines()[-1] if text else type(e).__name__}"
    return module, ""


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # `python -m tandem.spec_decode.native`: build ahead of time (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"tandem native suffix tree: {'ready' if native_suffix_tree() is not None else 'unavailable'} ({build_dir()})")
