"""CUDA graphs for decode and verification steps (placeholder, filled below)."""

from __future__ import annotations

import os

import torch


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs on for a CUDA runner unless TANDEM_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
