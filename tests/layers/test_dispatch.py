"""Kernel dispatch: the path each weight format takes is one this CPU (and the build) supports, and the CPU's
features are read right from /proc/cpuinfo (an AMD EPYC and an Intel Xeon with AMX as written there)."""

from __future__ import annotations

import torch

from tandem.cpu_features import cpu_features
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import kernel_paths

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vl
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vl
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""


def test_cpuinfo_is_read_as_written() -> None:
    amd, intel = cpu_features(EPYC), cpu_features(XEON)
    assert (amd.model, amd.vendor, amd.amx) == ("AMD EPYC", "AMD", False)
    assert amd.isa_summary() == "avx2 fma avx512f avx512bw avx512_vnni avx512_bf16, no AMX"
    assert (intel.vendor, intel.amx) == ("Intel", True)
    assert intel.isa_summary().endswith("avx512_fp16 amx_tile amx_bf16 amx_int8")
    assert cpu_features("").flags == frozenset()


def test_dispatch_picks_a_path_this_cpu_supports() -> None:
    cpu = cpu_features()
    paths = kernel_paths()
    if paths["bf16"] == "tandem avx512-bf16 gemm":
        assert cpu.has("avx512f", "avx512_bf16")
    elif paths["bf16"] == "tandem amx-bf16 tiles":
        assert cpu.amx and cpu.has("avx512_bf16")
    if cpu.amx and load_cpu_kernels():  # the build for an AMX CPU has the tiles, and Linux lets this process use them
        assert torch.ops.tandem.has_amx_bf16()
    if paths["quantized"].startswith("avx512-vnni"):
        assert cpu.has("avx512_vnni", "avx512bw")
        if "amx-int8" in paths["quantized"]:
            assert cpu.has("amx_tile", "amx_int8")
    elif paths["quantized"] == "avx2":
        assert cpu.has("avx2", "fma")
    if load_cpu_kernels() and cpu.has("avx2", "fma"):  # the kernels exist for every x86 CPU of this project's kinds
        assert paths["quantized"] != "dequantized to bf16"
