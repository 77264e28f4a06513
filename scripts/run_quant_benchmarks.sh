#!/usr/bin/env bash
# The quantized-weights and memory figures of docs/benchmarks.md (issue 12): tandem and llama.cpp (make llama-cpp) on
# the same real-shaped random-weight model files (written once under $TANDEM_HOME/test-models: ~12 GB in all with the
# 8B file), 128 prompt tokens, 128 new tokens, greedy; batch 1 and 32 concurrent. ~1 hour on 2 cores.
# Output: docs/bench/quant_*.txt and *.json.
set -uo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tandem
mkdir -p docs/bench
for shape in smollm2-135m smollm2-360m smollm2-1.7b; do
    $T bench throughput --shape "$shape" --formats BF16,Q8_0,Q4_1,Q4_K_M --concurrency 1,32 --prompts-per-level 4,64 \
        --input-len 128 --output-len 128 --json "docs/bench/quant_$shape.json" 2>&1 | grep -v "it/s\]" \
        > "docs/bench/quant_$shape.txt"
done
# int8 weights from a safetensors folder (quantization="int8") vs bf16, and llama.cpp Q8_0 beside them
$T bench throughput --shape smollm2-360m --formats hf,hf-int8 --concurrency 1,32 --prompts-per-level 4,64 \
    --input-len 128 --output-len 128 --json docs/bench/quant_int8.json 2>&1 | grep -v "it/s\]" > docs/bench/quant_int8.txt
# the 8B-shaped Q4_K_M model with a 1 GiB KV cache: resident memory after load and at the peak of serving
$T bench throughput --shape llama3.1-8b --formats Q4_K_M --concurrency 1 --prompts-per-level 2 --output-len 16 \
    --kv-cache-memory 1GiB --peers none --json docs/bench/memory_8b.json 2>&1 | grep -v "it/s\]" > docs/bench/memory_8b.txt
