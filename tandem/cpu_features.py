"""What this CPU is and which instruction sets it has (read from /proc/cpuinfo at call time, never at import).

The kernels choose their paths from what the compiler and the CPU support (`layers/linear.py: kernel_paths`);
benchmarks name the CPU and those paths in their machine line, since figures differ between an AMD EPYC (AVX-512
BF16 / VNNI) and an Intel Xeon (the same plus AMX tiles).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

# the flags that decide a kernel path, in the order they are reported
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def amx(self) -> bool:
        """AMX tiles with bf16 and int8 multiplies (Sapphire Rapids and later)."""
        return self.has("amx_tile", "amx_bf16", "amx_int8")

    @property
    def vendor(self) -> str:
        m = self.model.lower()
        return "AMD" if "amd" in m else "Intel" if "intel" in m else "other"

    def isa_summary(self) -> str:
        """The deciding flags present, e.g. 'avx2 fma avx512f avx512bw avx512_vnni avx512_bf16, no AMX'."""
        present = " ".join(f for f in ISA_FLAGS if f in self.flags) or "no AVX2"
        return present if self.amx else f"{present}, no AMX"


def cpu_features(cpuinfo: str | None = None) -> CpuFeatures:
    """This CPU's model name and flags (`cpuinfo`: the text of /proc/cpuinfo, for tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return CpuFeatures(platform.processor() or platform.machine(), frozenset())
    model, flags = "", ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return CpuFeatures(model or platform.processor() or platform.machine(), frozenset(flags.split()))
