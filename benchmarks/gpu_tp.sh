#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU host (nvidia-h200-x2), in one call, from the repository root:
#
#   bash benchmarks/gpu_tp.sh          # logs under $OUT (default: out/gpu_tp)
#
# a. correctness: tiny random checkpoints, triton + CUDA graphs, tp 1 vs tp 2 (and vs
#    transformers), bf16 and fp32 (benchmarks/gpu_correctness.py --tp-size 2)
# b. Llama-3.1-70B shapes, dummy bf16 weights, tp 2: one static batch of 1 / 8 / 32 / 64
#    requests at context 1024, decode with overlap (radixserve bench one-batch --tp-size 2)
# c. the same model offline: random 1024/1024, TP_OFFLINE_PROMPTS prompts (default 500)
# TP_STEPS="correctness one_batch offline dp lb" picks the steps (default: the first three; dp
# and lb below are separate calls). NCCL's multicast
# stays as the host sets it (NCCL_NVLS_ENABLE=0).
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_tp "${TP_STEPS:-correctness one_batch offline}"
MODEL=benchmarks/configs/llama-3.1-70b
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt" 2>&1
env | grep -E '^NCCL_' >> "$OUT/env.txt"

if step correctness; then
    echo "== correctness"
    timeout -k 10 "${TP_CORR_SECONDS:-200}" python3 benchmarks/gpu_correctness.py --tp-size 2 \
        --checkpoints hd128-gqa4 mistral-swa32 --time-budget $(( ${TP_CORR_SECONDS:-200} - 40 )) \
        --out "$OUT" > "$OUT/correctness.log" 2>&1
    echo "   rc $?: $(grep '^correctness:' "$OUT/correctness.log" || tail -2 "$OUT/correctness.log")"
    grep -E '^(FAIL|TIE) ' "$OUT/correctness.log" | cut -c1-220 | head -12
fi
if step one_batch; then
    echo "== one_batch (70B shapes, tp 2)"
    timeout -k 10 "${TP_ONE_BATCH_SECONDS:-240}" python3 -m radixserve.bench.one_batch \
        --model-path "$MODEL" --load-format dummy --dtype bfloat16 --tp-size 2 \
        --batch-size 1 8 32 64 --input-len 1024 --output-len 64 --overlap \
        --cuda-graph-max-bs 64 --max-total-tokens 100000 --log-level warning \
        --output-file "$OUT/one_batch.jsonl" > "$OUT/one_batch.log" 2>&1
    echo "   rc $?"
    grep -v -E 'Warning|return func' "$OUT/one_batch.log" | tail -8
fi
if step offline; then
    echo "== offline (70B shapes, tp 2, ${TP_OFFLINE_PROMPTS:-500} x 1024/1024)"
    timeout -k 10 "${TP_OFFLINE_SECONDS:-330}" python3 -m radixserve.bench.offline \
        --model-path "$MODEL" --load-format dummy --dtype bfloat16 --tp-size 2 --radix on \
        --cuda-graph-max-bs 256 \
        --dataset-name random --num-prompts "${TP_OFFLINE_PROMPTS:-500}" \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
        --output-file "$OUT/offline.jsonl" > "$OUT/offline.log" 2>&1
    echo "   rc $?"
    grep -v -E 'Warning|return func|Decode batch|Prefill batch' "$OUT/offline.log" | tail -6
    grep -E 'Decode batch' "$OUT/offline.log" | tail -3
fi

# d. data parallelism: Llama-3.1-8B served with --dp-size 1 then 2 (one replica per GPU), the
#    same random 1024/1024 x DP_PROMPTS (default 1000) streamed at rate inf (goal: dp 2 >= 1.9x)
# e. load balancing with dp 2: round_robin vs cache_aware on the shared-prefix set (shuffled, so
#    a group's prompts arrive apart); cache hit rate from /metrics and throughput side by side
L8="${DP_MODEL:-benchmarks/configs/llama-3.1-8b}"
serve_and_bench() {  # label port "bench flags" server-flags...
    local label=$1 port=$2 bench_flags=$3
    shift 3
    start_server "$port" "$OUT/server_$label.log" --model-path "$L8" --load-format dummy \
        --dtype bfloat16 --skip-tokenizer-init "$@"
    # shellcheck disable=SC2086
    timeout -k 10 "${DP_BENCH_SECONDS:-240}" python3 -m radixserve.bench.serving \
        --backend radixserve --base-url "http://127.0.0.1:$port" --request-rate inf \
        $bench_flags --output-file "$OUT/serving_$label.jsonl" > "$OUT/serving_$label.log" 2>&1
    echo "   $label rc $?: $(grep -E 'Output token throughput|Request throughput' \
        "$OUT/serving_$label.log" | tr -s ' ' | tr '\n' ' ')"
    echo "   $label $(curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^radixserve:cache_hit_rate' | head -2 | tr '\n' ' ')"
    stop_server
}
RANDOM_SET="--dataset-name random --num-prompts ${DP_PROMPTS:-1000} --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0"
GSP_SET="--dataset-name generated-shared-prefix --gsp-shuffle"
if step dp; then
    echo "== data parallelism, Llama-3.1-8B"
    serve_and_bench dp1 30401 "$RANDOM_SET" --dp-size 1
    serve_and_bench dp2 30402 "$RANDOM_SET" --dp-size 2
fi
if step lb; then
    echo "== load balancing, dp 2, shared-prefix set"
    serve_and_bench lb_round_robin 30403 "$GSP_SET" --dp-size 2 --load-balance-method round_robin
    serve_and_bench lb_cache_aware 30404 "$GSP_SET" --dp-size 2 --load-balance-method cache_aware
fi
