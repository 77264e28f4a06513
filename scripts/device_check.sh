#!/usr/bin/env bash
# One prepared run on a lent accelerator machine (see the developers' guide): CUDA parity tests and the benchmarks,
# a few minutes in all, a short table at the end. Results go to $OUT (or ./out). Changes no device setting.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export TANDEM_HOME=${TANDEM_HOME:-$OUT/tandem-home}
make setup > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
PY=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -m pytest -q tests/models/test_parity.py -k cuda 2>&1 | tail -3 | tee "$OUT/parity.txt"
timeout 150 .venv/bin/tandem bench throughput --device cuda --concurrency 1,32 --prompts-per-level 4,64 \
    --output-len 128 --peers hf --json "$OUT/throughput.json" > "$OUT/throughput.txt" 2>&1
timeout 150 .venv/bin/tandem bench structured --device cuda --concurrency 1,64 --prompts-per-level 4,64 \
    --peers none --mask-vocab o200k_base --json "$OUT/structured.json" > "$OUT/structured.txt" 2>&1
timeout 150 .venv/bin/tandem bench spec --device cuda --methods ngram,suffix,draft_model --ks 0,4,adaptive \
    --batches 1,32 --workloads copy,mt_bench --peers none --plot "$OUT/spec.png" --json "$OUT/spec.json" \
    --draft-threads 8 > "$OUT/spec.txt" 2>&1
for f in throughput structured spec; do echo "== $f"; grep "^|" "$OUT/$f.txt" | tail -14; done
