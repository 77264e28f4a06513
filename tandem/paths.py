"""Where tandem keeps what it derives: converted models, built kernels (read at call time, never at import)."""

from __future__ import annotations

import os
from pathlib import Path


def tandem_home() -> Path:
    """Root of tandem's caches: $TANDEM_HOME, else ~/.cache/tandem (read at call time, not at import)."""
    env = os.environ.get("TANDEM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"
