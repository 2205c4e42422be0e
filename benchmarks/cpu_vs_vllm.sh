#!/usr/bin/env bash
# Issue 16's side-by-side on this CPU: radixserve and vLLM-CPU (installed by
# ../shared/peers/vllm_cpu/setup.sh into $PEER) alternated on the same SmolLM2-135M weights,
# ROUNDS times (default 2), from the repository root:
#   bash benchmarks/cpu_vs_vllm.sh [OUT_DIR]          (~15 min per round on 2 cores)
# Per round, in this order: ours offline bf16 and fp32 (batch-1 greedy tok/s and 64 x 128/128
# out tok/s, `bench.engine_vs_hf --skip-hf`), vLLM offline bf16 and fp32 (the peer's
# offline_bench.py, two runs each), then both servers streaming `bench serving` 64 x 128/128 at
# rate inf through /v1/completions with the same client (ours first, then vLLM's).
# SERVE_DTYPES (default bfloat16) lists the served dtypes; VLLM_REPEATS (default 2) the peer's
# runs of each offline figure (its emulated-bf16 batch run takes ~4.6 min on an AVX2 CPU).
# Leave the machine otherwise idle: a 2-thread step stalls whenever another process takes a core.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-out/cpu_vs_vllm}"
mkdir -p "$OUT"
PEER="${PEER:-$HOME/.cache/rs-peer}"
PEER_DIR="$(cd ../shared/peers/vllm_cpu 2>/dev/null && pwd)"
MODEL="$PEER/smollm2-hf"
VLLM_ENV=(HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1
          VLLM_CPU_NUM_OF_RESERVED_CPU=0)
if [ ! -x "$PEER/vllm-venv/bin/python" ] || [ ! -d "$MODEL" ]; then
    echo "vLLM-CPU is not installed under $PEER: run ../shared/peers/vllm_cpu/setup.sh first"
    exit 1
fi
serve_bench() {  # label port
    timeout 600 python3 -m radixserve.bench.serving --backend openai \
        --base-url "http://127.0.0.1:$2" --tokenizer "$MODEL" --dataset-name random \
        --num-prompts 64 --random-input-len 128 --random-output-len 128 --random-range-ratio 1.0 \
        --request-rate inf --disable-tqdm > "$OUT/serve_$1.log" 2>&1
    echo "$(date -u +%H:%M) $1 served: $(grep -E 'Output token throughput' "$OUT/serve_$1.log")"
}
wait_health() {  # url seconds
    for _ in $(seq "$2"); do curl -sf "$1" > /dev/null 2>&1 && return 0; sleep 1; done
    return 1
}
for round in $(seq "${ROUNDS:-2}"); do
    for dtype in bfloat16 float32; do
        python3 -m radixserve.bench.engine_vs_hf --dtype $dtype --skip-hf --model-path "$MODEL" \
            > "$OUT/ours_${dtype}_$round.log" 2>&1
        echo "$(date -u +%H:%M) ours $dtype: $(tail -1 "$OUT/ours_${dtype}_$round.log")"
        env "${VLLM_ENV[@]}" "$PEER/vllm-venv/bin/python" "$PEER_DIR/offline_bench.py" \
            --model "$MODEL" --dtype $dtype --repeats "${VLLM_REPEATS:-2}" \
            > "$OUT/vllm_${dtype}_$round.log" 2>&1
        echo "$(date -u +%H:%M) vllm $dtype: $(grep RESULT "$OUT/vllm_${dtype}_$round.log")"
    done
    for dtype in ${SERVE_DTYPES:-bfloat16}; do
        python3 -m radixserve.launch_server --port 31950 --dtype $dtype --model-path "$MODEL" \
            > "$OUT/ours_server_${dtype}_$round.log" 2>&1 &
        OURS=$!
        wait_health http://127.0.0.1:31950/health 300 && serve_bench "ours_${dtype}_$round" 31950
        kill $OURS; wait $OURS 2>/dev/null
        DTYPE=$dtype PORT=8100 bash "$PEER_DIR/serve.sh" > /dev/null
        wait_health http://127.0.0.1:8100/health 400 && serve_bench "vllm_${dtype}_$round" 8100
        pkill -f "vllm.entrypoints.openai.api_server" ; sleep 5
    done
done
