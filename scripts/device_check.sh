#!/usr/bin/env bash
# The one prepared run on a lent accelerator machine, offline, on its own Python and torch (docs/benchmarks.md):
#   here:   make device-wheels          (.device/: the missing wheels and the GPT-2 tokenizer, ignored, < 64 MiB)
#   there:  run with carry [".device"]:  bash scripts/device_check.sh
# Installs the carried wheels into /tmp/tandem-site (on PYTHONPATH, beside the machine's own torch and triton), runs
# the CUDA tests and `python -m tandem.bench.device_check`; writes device_check.md / .json and the logs to $OUT
# (7 files: at most 8 come back).
# The last CUDA tests (experts on the host) and the last section may build tandem's CPU kernels once (into
# $TANDEM_HOME; a machine without a compiler falls back to torch's). Changes no device setting. Well under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export TANDEM_HOME=${TANDEM_HOME:-/tmp/tandem-home} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SITE=/tmp/tandem-site
test -d .device/wheels || { echo "no .device/wheels: run 'make device-wheels' here and carry .device" >&2; exit 2; }
# --target, not a venv: the machine's python3 is itself a venv (/opt/torch/.venv), and a venv made from it with
# --system-site-packages would see the base interpreter's packages, not its torch
PY=python3
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/wheels/*.whl \
    > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/gpu.txt"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
timeout 180 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -m cuda \
    tests/layers/test_paged_decode.py tests/runner tests/models/test_parity.py tests/layers/test_quant.py \
    tests/test_device_check.py tests/models/test_moe_offload.py > "$OUT/cuda_tests.txt" 2>&1
echo "cuda tests: $(tail -1 "$OUT/cuda_tests.txt")"
timeout 360 "$PY" -m tandem.bench.device_check --device cuda --out "$OUT" 2> "$OUT/device_check.log"
status=$?
tail -5 "$OUT/device_check.log"
exit $status
