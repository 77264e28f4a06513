#!/usr/bin/env bash
# The figures of docs/benchmarks.md, "Speculation scheduled ahead (issue 25)": the simulated accelerator with the
# demo model's replayed outputs (recorded once under $TANDEM_HOME/replay), timed as a device model or a fixed step,
# and the real CPU engine with and without scheduling ahead. ~25 minutes on 2 cores; run with nothing else running.
# Output: docs/bench/spec_ahead_*.txt and *.json. The distilled draft rows need `make draft` first.
set -uo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tandem
mkdir -p docs/bench
run() {  # name, then the bench arguments
    local name=$1
    shift
    "$T" bench "$@" 2>&1 | grep -v "it/s\]" > "docs/bench/spec_ahead_$name.txt"
}
# 256 concurrent beside a 20 ms step: the host's wait, drafts or not, guided or not (replayed and random logits)
run step20_replay simulated --step-ms 20 --logits replay --concurrency 256 \
    --modes text,guided,suffix,guided+suffix --json docs/bench/spec_ahead_step20_replay.json
run step20_table simulated --step-ms 20 --concurrency 256 --modes text,guided,guided+suffix \
    --json docs/bench/spec_ahead_step20_table.json
# the CPU-draft setup: Llama-2-7B fp16 on an RTX 4090 as the target's timing, drafts computed on this machine
run rtx4090_chat simulated --logits replay --device-model llama2-7b-rtx4090 --workload mt_bench --concurrency 1,8 \
    --requests 16 --output-len 128 --modes text,ngram,suffix,draft,draft-groups,draft-sequential \
    --drafts q4_1,distilled,distilled:16384 --draft-threads 2 --json docs/bench/spec_ahead_rtx4090_chat.json
run rtx4090_copy simulated --logits replay --device-model llama2-7b-rtx4090 --workload copy --concurrency 1 \
    --requests 16 --output-len 128 --modes text,ngram,suffix --spec-k 8 --json docs/bench/spec_ahead_rtx4090_copy.json
# Llama-3.1-8B bf16 on an H200, 64 concurrent chat requests
run h200_chat simulated --logits replay --device-model llama3.1-8b-h200 --workload mt_bench --concurrency 64 \
    --requests 80 --output-len 128 --modes text,ngram,suffix --json docs/bench/spec_ahead_h200_chat.json
# the real CPU engine (the demo model in bf16 on these cores), scheduled ahead and not
for mode in async-scheduling no-async-scheduling; do
    run "cpu_$mode" spec --methods suffix --ks adaptive --batches 1,32 --workloads copy,mt_bench --peers none \
        --plot '' --"$mode" --json "docs/bench/spec_ahead_cpu_$mode.json"
done
