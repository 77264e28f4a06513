#!/usr/bin/env bash
# The Intel AMX figures of docs/benchmarks.md (issue 29), run alone on the machine: bf16 projections (tandem's GEMM on
# AVX512-BF16 and on AMX tiles, oneDNN, F.linear) on two shapes, then the demo model in bf16 against HF transformers
# (batch 1, 32 concurrent x 128 tokens, a 1,000-token prefill) with this CPU's plan and with the pre-AMX settings
# (TANDEM_BF16_GEMM=avx512, TANDEM_PREFILL_ATTENTION=float32) in the same run, and the formats against llama.cpp.
# Then alternating A/B pairs. ~30 minutes on 2 cores. Output: docs/bench/amx_*.txt and *.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
T=.venv/bin/tandem
mkdir -p docs/bench
{
    for shape in "1536 576" "8192 2048"; do
        set -- $shape
        $PY scripts/bench_quant_kernels.py --n "$1" --k "$2" --rows 1,32,128,512 \
            --only bf16-avx512,bf16-amx,onednn,F.linear --gflops
    done
} > docs/bench/amx_projections.txt 2>&1
for run in amx before; do
    env_args=()
    [ "$run" = before ] && env_args=(TANDEM_BF16_GEMM=avx512 TANDEM_PREFILL_ATTENTION=float32)
    env "${env_args[@]}" $T bench throughput --dtype bfloat16 --workloads fixed --peers hf --prefill-len 1000 \
        --json "docs/bench/amx_demo_bf16_$run.json" 2>&1 | grep -v "it/s\]" > "docs/bench/amx_demo_bf16_$run.txt"
done
$T bench throughput --shape smollm2-135m --formats BF16,Q8_0,Q4_K_M --concurrency 1,32 --prompts-per-level 4,64 \
    --input-len 128 --output-len 128 --json docs/bench/amx_formats.json 2>&1 | grep -v "it/s\]" > docs/bench/amx_formats.txt
# alternating A/B pairs in one run: bf16 batch 1 with each unit forced, Q8_0 at 32 concurrent with AMX int8 on / off
for round in 1 2; do
    for plan in amx avx512; do
        echo "== round $round bf16 batch1 plan=$plan"
        TANDEM_BF16_GEMM=$plan $T bench throughput --dtype bfloat16 --workloads fixed --peers none --concurrency 1 \
            --prompts-per-level 4 2>&1 | grep "| fixed" | tail -1
    done
    for rows in 16 0; do
        echo "== round $round Q8_0 32-concurrent int8_amx_rows=$rows"
        TANDEM_INT8_AMX_ROWS=$rows $T bench throughput --shape smollm2-135m --formats Q8_0 --concurrency 32 \
            --prompts-per-level 64 --peers none 2>&1 | grep "| smollm2" | tail -1
    done
done > docs/bench/amx_ab_pairs.txt
