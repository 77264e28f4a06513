"""llama.cpp as a peer (llama-cpp-python, built from source): built so that it runs where it is built, and checked
before anything compares against it.

`build()` (`make llama-cpp`) tries one build after another until one passes the smoke test (`smoke_test`: a fresh
process loads the demo model's Q4_1 file, evaluates an 8-token prompt in one batch and generates 4 tokens):
  1. native (`-march=native`) with AMX left out (`-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`): ggml compiles its AMX
     int8 path whenever the compiler targets AMX, and on the Intel Xeons of this project's kind that path dies with a
     general protection fault in libggml-cpu.so as soon as a batch has more than one token (issue 29). Without it
     llama.cpp runs its AVX512-VNNI kernels, the ones it runs on an AMD EPYC. `LLAMA_CPP_AMX=1` tries the native
     build with AMX first (kept only if it passes the smoke test);
  2. a portable AVX2 build.
When none passes, llama-cpp-python is uninstalled and the reasons are written beside the interpreter: the peer's
tests then skip saying why, and benchmarks leave the peer out saying why.

`peer_status()` is what tests and benchmarks ask: whether the installed peer runs here, which build it is and what
llama.cpp reports of itself (`llama_print_system_info`). The smoke test's verdict is cached per library file and CPU
under `$TANDEM_HOME/peers`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

PACKAGE = "llama-cpp-python"
DEFAULT_VERSION = "0.3.36"
# the parts of llama.cpp the peer does not use
BASE_CMAKE = "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PORTABLE_X86 = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
SMOKE_TOKENS = 8  # one batch of this many tokens: the shape that killed the AMX build (a 1-token prompt ran)
SMOKE_TIMEOUT_S = 300
BUILD_RECORD = "tandem-llama-cpp-build.json"  # beside the interpreter (sys.prefix): what make llama-cpp built


@dataclass(frozen=True)
class BuildAttempt:
    """One way of building the peer: CMake arguments and extra compiler flags."""

    name: str
    cmake_args: str
    cflags: str = ""


@dataclass
class PeerStatus:
    """The installed llama.cpp peer as seen from here."""

    usable: bool
    reason: str = ""  # why it is not usable (or not checked)
    version: str = ""
    build: str = ""  # the BuildAttempt's name, or what is known of a build made elsewhere
    system_info: str = ""  # llama_print_system_info(): the ISA paths llama.cpp compiled in
    checked: list[str] = field(default_factory=list)  # what the smoke test ran

    def describe(self) -> str:
        """One line for test headers, skip reasons and benchmark tables."""
        if not self.usable:
            return f"llama.cpp peer unusable: {self.reason}"
        parts = (part.split(":")[-1].strip() for part in self.system_info.split("|"))  # "CPU : SSE3 = 1 | ..."
        features = " ".join(part.replace(" = 1", "") for part in parts if part.endswith("= 1"))
        return f"llama.cpp peer: {PACKAGE} {self.version}, build '{self.build}', {features or 'no ISA report'}"


# ------------------------------------------------------------------------------------------------ what to build
def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def compiler_accepts(flags: str, compiler: str | None = None) -> bool:
    """Whether the C compiler (CC, else cc) takes `flags` (e.g. an older gcc has no -mno-amx-*)."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    probe = subprocess.run([cc, *flags.split(), "-x", "c", "-E", "-"], input=b"", capture_output=True, check=False)
    return probe.returncode == 0


def build_attempts(native_cmake: str = "-DGGML_NATIVE=ON", try_amx: bool = False) -> list[BuildAttempt]:
    """The builds `build` tries, in order (module doc)."""
    base = f"{native_cmake} {BASE_CMAKE}"
    if not x86():
        return [BuildAttempt("native", base), BuildAttempt("portable", f"-DGGML_NATIVE=OFF {BASE_CMAKE}")]
    attempts = [BuildAttempt("native with AMX", base)] if try_amx else []
    no_amx = NO_AMX if compiler_accepts(NO_AMX) else ""  # a compiler without those flags never targets AMX
    attempts.append(BuildAttempt("native, AMX off", base, no_amx))
    attempts.append(BuildAttempt("portable AVX2", f"{PORTABLE_X86} {BASE_CMAKE}"))
    return attempts


# ------------------------------------------------------------------------------------------------- building
def build(version: str = DEFAULT_VERSION, native_cmake: str = "-DGGML_NATIVE=ON", try_amx: bool = False) -> PeerStatus:
    """Build and install the peer, falling back through `build_attempts` until one passes the smoke test; returns
    the status of what is installed in the end (uninstalled, with every attempt's failure, when none passed)."""
    failures: list[str] = []
    for attempt in build_attempts(native_cmake, try_amx):
        print(f"llama.cpp peer: building {PACKAGE}=={version} ({attempt.name}: {attempt.cmake_args} {attempt.cflags})",
              flush=True)
        rc = _pip_install(version, attempt)
        if rc != 0:
            failures.append(f"{attempt.name}: pip install exited {rc}")
            continue
        _write_record({"build": attempt.name, "cmake_args": attempt.cmake_args, "cflags": attempt.cflags})
        status = peer_status(refresh=True)
        print(status.describe(), flush=True)
        if status.usable:
            return status
        failures.append(f"{attempt.name}: {status.reason}")
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", PACKAGE], check=False)
    reason = "no build of llama.cpp passed the smoke test here (" + "; ".join(failures) + ")"
    _write_record({"build": "none", "failed": reason})
    return PeerStatus(False, reason)


def _pip_install(version: str, attempt: BuildAttempt) -> int:
    env = dict(os.environ, CMAKE_ARGS=attempt.cmake_args)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    for var in ("CFLAGS", "CXXFLAGS"):  # CMake starts CMAKE_<LANG>_FLAGS from these
        env[var] = f"{os.environ.get(var, '')} {attempt.cflags}".strip()
    # uninstalled first and no wheel cache: a wheel built with another attempt's flags would be reinstalled as it
    # is; dependencies already there stay as they are
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", PACKAGE], check=False)
    cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-binary", PACKAGE, f"{PACKAGE}=={version}"]
    return subprocess.run(cmd, env=env, check=False).returncode


def _record_path() -> Path:
    return Path(sys.prefix) / BUILD_RECORD


def _write_record(record: dict[str, str]) -> None:
    _record_path().write_text(json.dumps(record, indent=2) + "\n")


def _read_record() -> dict[str, str]:
    try:
        return dict(json.loads(_record_path().read_text()))
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ checking
_STATUS: dict[str, PeerStatus] = {}


def peer_status(refresh: bool = False) -> PeerStatus:
    """The installed peer: not installed, or smoke-tested (once per library file and CPU; `refresh` tests again)."""
    if not refresh and "status" in _STATUS:
        return _STATUS["status"]
    status = _check(refresh)
    _STATUS["status"] = status
    return status


def _check(refresh: bool) -> PeerStatus:
    record = _read_record()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        why = record.get("failed") or f"{PACKAGE} is not installed (make llama-cpp builds it)"
        return PeerStatus(False, why)
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    cache = _cache_file(package_dir)
    if not refresh and cache.is_file():
        try:
            return PeerStatus(**json.loads(cache.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    status = smoke_test(record.get("build", "built outside make llama-cpp"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(status), indent=2) + "\n")
    return status


def _cache_file(package_dir: Path) -> Path:
    """$TANDEM_HOME/peers/llama_cpp-<key>.json, the key over the peer's libraries (path, size, mtime) and the CPU."""
    from tandem.layers.kernels import cpu_signature
    from tandem.paths import tandem_home

    h = hashlib.sha256(cpu_signature().encode())
    for lib in sorted(package_dir.rglob("*.so*")) + sorted(package_dir.rglob("*.dylib")):
        st = lib.stat()
        h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode())
    return tandem_home() / "peers" / f"llama_cpp-{h.hexdigest()[:16]}.json"


def smoke_test(build_name: str, model: Path | None = None, timeout_s: float = SMOKE_TIMEOUT_S) -> PeerStatus:
    """Run the peer in a fresh process on `model` (default: the demo model's GGUF): an 8-token batch, then 4 greedy
    tokens. A crash, a hang or an error there makes the peer unusable, with what happened as the reason."""
    if model is None:
        from tandem.config import ConfigError
        from tandem.models.demo import find_demo_gguf

        try:
            model = find_demo_gguf()
        except ConfigError as e:
            return PeerStatus(False, f"not smoke-tested: {e}", build=build_name)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "smoke.json"
        cmd = [sys.executable, "-m", "tandem.bench.llama_peer", "smoke", str(model), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return PeerStatus(False, f"build '{build_name}' hung for {timeout_s:g} s on a {SMOKE_TOKENS}-token batch",
                              build=build_name)
        if proc.returncode != 0 or not out.is_file():
            return PeerStatus(False, f"build '{build_name}' {_death(proc.returncode)} on a {SMOKE_TOKENS}-token batch "
                                     f"of {model.name}: {_tail(proc.stderr)}", build=build_name)
        report = json.loads(out.read_text())
    return PeerStatus(True, "", report["version"], build_name, report["system_info"], report["checked"])


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited {returncode}"


def _tail(text: str, limit: int = 300) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return (" / ".join(lines[-3:]))[-limit:] or "no output"


def _smoke_child(model: Path, out: Path) -> None:
    """In the child: the peer on `model`, one multi-token batch then a few greedy tokens; the report as JSON."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=64, n_threads=len(os.sched_getaffinity(0)), n_batch=32,
                          logits_all=True, verbose=False)
    prompt = llm.tokenize(b"The capital of France is the city of")[:SMOKE_TOKENS]
    prompt += [prompt[-1]] * (SMOKE_TOKENS - len(prompt))
    llm.eval(prompt)
    generated = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        generated.append(int(tok))
        if len(generated) >= 4:
            break
    info = llama_cpp.llama_print_system_info()
    out.write_text(json.dumps({
        "version": getattr(llama_cpp, "__version__", ""),
        "system_info": info.decode() if isinstance(info, bytes) else str(info),
        "checked": [f"eval of a {len(prompt)}-token batch", f"{len(generated)} greedy tokens"],
    }))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.llama_peer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build and install the peer, falling back until a build passes the smoke test")
    b.add_argument("--version", default=DEFAULT_VERSION)
    b.add_argument("--native-cmake", default="-DGGML_NATIVE=ON", help="CMake arguments of the native build")
    sub.add_parser("status", help="print the installed peer's status (smoke-tested once per build); exit 1 if unusable")
    s = sub.add_parser("smoke", help="(the child of the smoke test)")
    s.add_argument("model", type=Path)
    s.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "smoke":
        _smoke_child(args.model, args.out)
        return 0
    if args.cmd == "build":
        status = build(args.version, args.native_cmake, try_amx=os.environ.get("LLAMA_CPP_AMX") == "1")
    else:
        status = peer_status()
    print(status.describe())
    return 0 if status.usable else 1


if __name__ == "__main__":
    sys.exit(main())
