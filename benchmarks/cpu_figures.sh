#!/usr/bin/env bash
# The CPU figures of issues 3, 4 and 6 on the bundled SmolLM2-135M (bf16), one after another.
#   bash benchmarks/cpu_figures.sh [OUT_DIR]      (about 15 minutes on 2 cores)
# Every run appends JSON lines to OUT_DIR/*.jsonl and prints its table; run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/cpu_figures}"
mkdir -p "$OUT"
PORT=${PORT:-31900}
DT=bfloat16

echo "== one-batch: batch 1 and 16, 128 in / 64 out"
python3 -m radixserve.bench.one_batch --dtype $DT --batch-size 1 16 --input-len 128 \
    --output-len 64 --output-file "$OUT/one_batch.jsonl"

echo "== offline: shared-prefix set, radix cache on and off"
python3 -m radixserve.bench.offline --dtype $DT --dataset-name generated-shared-prefix \
    --gsp-num-groups 4 --gsp-prompts-per-group 16 --gsp-system-prompt-len 512 \
    --gsp-question-len 32 --gsp-output-len 32 --radix both --output-file "$OUT/offline_gsp.jsonl"

echo "== offline: random 128/128 x 64 (the HTTP comparison's workload)"
python3 -m radixserve.bench.offline --dtype $DT --dataset-name random --num-prompts 64 \
    --random-input-len 128 --random-output-len 128 --random-range-ratio 1.0 --radix on \
    --output-file "$OUT/offline_random.jsonl"

echo "== chunked prefill: 16 streams, 4 prompts of 8 x 128 tokens, chunking off / on / mixed"
python3 -m radixserve.bench.chunked_itl --dtype $DT --chunk-size 128 --mixed \
    --output-file "$OUT/chunked_itl.jsonl"

echo "== server: bench serving random 128/128 x 64 at rate inf and 4, 1-token round trips"
python3 -m radixserve.launch_server --port $PORT --dtype $DT > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
for rate in inf 4; do
    python3 -m radixserve.bench.serving --backend radixserve --port $PORT --dataset-name random \
        --num-prompts 64 --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1.0 --request-rate $rate --flush-cache --disable-tqdm \
        --output-file "$OUT/serving.jsonl"
done
python3 -m radixserve.bench.serving --backend radixserve --port $PORT --dataset-name random \
    --num-prompts 32 --random-input-len 16 --random-output-len 1 --random-range-ratio 1.0 \
    --max-concurrency 1 --disable-tqdm --output-file "$OUT/round_trip.jsonl"
python3 -m radixserve.bench.serving --backend radixserve --port $PORT \
    --dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 16 \
    --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 32 --flush-cache \
    --disable-tqdm --output-file "$OUT/serving_gsp.jsonl"
