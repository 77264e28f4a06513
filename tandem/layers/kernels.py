"""Build and load tandem's CPU kernels (`csrc/cpu_ops.cpp`, `csrc/quant_ops.cpp`, `csrc/moe_ops.cpp`, registered as
`torch.ops.tandem.*`).

The sources are compiled once per (sources, torch version, CPU) with the host's C++ compiler into
`$TANDEM_HOME/kernels/<key>/` and loaded from there afterwards; `make setup` builds it ahead of time. When no compiler
is found or the build fails, `load_cpu_kernels()` returns False with the reason logged once, and the model runs its
plain torch operations instead (same results up to float rounding, slower per step).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_ops.cpp", "quant_ops.cpp", "moe_ops.cpp", "decode_stack.cpp",
                                                                     "plan_ops.cpp")]
# part of the build key, not compiled on their own
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("amx_tiles.h", "float_types.h")]
# no FP traps or errno: lets gcc vectorise loops with floor / conversions (the kernels never read FP exception flags)
_CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-mprefer-vector-width=512", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_signature() -> str:
    """The CPU's model and feature flags: the build uses -march=native, so a cache shared across machines must not mix."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def build_key() -> str:
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        h.update(source.read_bytes())
    for part in (torch.__version__.encode(), cpu_signature().encode(), " ".join(_CFLAGS).encode()):
        h.update(part)
    return h.hexdigest()[:16]


def build_dir() -> Path:
    from tandem.paths import tandem_home

    return tandem_home() / "kernels" / build_key()


def load_cpu_kernels(verbose: bool = False) -> bool:
    """Compile (first time) and load the kernels into this process; True when `torch.ops.tandem` is ready."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = _build_and_load(verbose)
        _state["ok"] = ok
        if not ok:
            logger.warning("tandem CPU kernels unavailable (%s); using plain torch operations", why)
        return ok


def _build_and_load(verbose: bool) -> tuple[bool, str]:
    if hasattr(torch.ops, "tandem") and hasattr(torch.ops.tandem, "quant_linear"):
        return True, ""
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - part of every torch build
        return False, f"torch.utils.cpp_extension: {e}"
    ninja_on_path()
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    built = folder / "tandem_cpu_ops.so"
    if built.exists():  # the key covers the sources, torch, the CPU and the flags: load without asking ninja, whose
        try:  # build files name one checkout's source paths (another checkout would rebuild, 30-80 s per start)
            torch.ops.load_library(str(built))
            return True, ""
        except OSError as e:  # a foreign or broken file: build it again
            logger.info("rebuilding tandem CPU kernels (%s)", e)
    else:
        logger.info("building tandem CPU kernels into %s (once, ~30 s)", folder)
    try:
        cpp_extension.load(
            name="tandem_cpu_ops",
            sources=[str(s) for s in SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError, FileNotFoundError) as e:
        return False, f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    return True, ""


def ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel puts it next to this interpreter, which a venv
    used without activation does not have on PATH."""
    if shutil.which("ninja") is None:
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


if __name__ == "__main__":  # `python -m tandem.layers.kernels`: build ahead of time (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"tandem CPU kernels: {'ready' if load_cpu_kernels() else 'unavailable'} ({build_dir()})")
