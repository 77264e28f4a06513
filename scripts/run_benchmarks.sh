#!/usr/bin/env bash
# The benchmark runs recorded in docs/benchmarks.md (2-core CPU machine, demo model, bf16). ~40 minutes in all.
# Output: docs/bench/*.txt and *.json, docs/spec_speedup.png.
set -uo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tandem
mkdir -p docs/bench
$T bench throughput --concurrency 1,32 --prompts-per-level 4,64 --input-len 128 --output-len 128 \
    --json docs/bench/throughput.json 2>&1 | grep -v "it/s\]\|tensor/s" > docs/bench/throughput.txt
$T bench structured --concurrency 1,32 --prompts-per-level 4,32 --output-len 96 \
    --json docs/bench/structured.json 2>&1 | grep -v "it/s\]\|tensor/s" > docs/bench/structured.txt
$T bench spec --methods ngram,suffix,draft_model --ks 0,1,2,4,8,adaptive --batches 1 --workloads copy,mt_bench,humaneval \
    --output-len 96 --plot docs/spec_speedup.png --json docs/bench/spec_b1.json 2>&1 | grep -v "it/s\]\|tensor/s" > docs/bench/spec_b1.txt
$T bench spec --methods ngram,suffix --ks 0,4,adaptive --batches 8,32 --workloads copy,mt_bench --output-len 64 --peers none \
    --plot "" --json docs/bench/spec_batch.json 2>&1 | grep -v "it/s\]\|tensor/s" > docs/bench/spec_batch.txt
