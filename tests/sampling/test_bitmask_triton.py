"""The one-kernel bitmask apply (sampling/bitmask_triton.py) against the torch path, run by Triton's interpreter on
the CPU (so it is checked here, without an accelerator), in a subprocess because the interpreter must be chosen
before Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent('''
    import torch
    from tandem.sampling.bitmask import apply_token_bitmask_
    from tandem.sampling.bitmask_triton import apply_token_bitmask_triton_
    g = torch.Generator().manual_seed(0)
    for rows_n, vocab, words in [(3, 100, 4), (2, 64, 2), (4, 70, 2), (5, 1030, 33)]:  # 70 > 32 * 2: not covered
        logits = torch.randn(rows_n, vocab, generator=g)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows_n, words), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[0] = -1  # every token allowed
        bitmask[1] = 0  # none
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_(a, bitmask)  # CPU tensors: the torch path
        apply_token_bitmask_triton_(b, bitmask)
        assert torch.equal(a, b), (rows_n, vocab, words)
        sel = torch.tensor([rows_n - 1, 0])  # rows: bitmask row i applies to logits row sel[i]
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_(a, bitmask[:2], sel)
        apply_token_bitmask_triton_(b, bitmask[:2], sel)
        assert torch.equal(a, b)
    print("ok")
''')


def test_triton_kernel_matches_torch_path() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
