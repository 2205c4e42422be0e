#!/usr/bin/env bash
# The eight-GPU run (issue 18), from the repository root on an 8 x H200 host (device kind
# nvidia-h200-x8; TP_SIZE=4 on nvidia-h200-x4 for the 70B rows). Logs under $OUT.
#
#   STEPS="decode70 offline70 serving70" bash benchmarks/gpu_tp8.sh     # one call
#   STEPS="decode405 offline405" bash benchmarks/gpu_tp8.sh             # another
#   STEPS="tp_vs_dp" bash benchmarks/gpu_tp8.sh                          # a third
#
# decode70 / decode405: one static batch of 1 / 32 / 128 at context 1024, graphs + overlap
#   (Llama-3.1-70B bf16; Llama-3.1-405B with FP8 weights quantised at load and an FP8 KV cache)
# offline70 / offline405: random 1024/1024 x PROMPTS (default 1000)
# serving70: a server at tp TP_SIZE and `bench serving` at rates 4, 8, 16, inf (TTFT / ITL)
# tp_vs_dp: Llama-3.1-8B served at rate inf, --tp-size 8 against --dp-size 8
# Dummy weights throughout; NCCL multicast stays as the host sets it (NCCL_NVLS_ENABLE=0).
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_tp8 "${STEPS:-decode70 offline70 serving70 decode405 offline405 tp_vs_dp}"
TP="${TP_SIZE:-8}"
PROMPTS="${PROMPTS:-1000}"
quiet() { grep -v -E 'Warning|return func|warnings.warn|Decode batch|Prefill batch'; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt" 2>&1
env | grep -E '^NCCL_' >> "$OUT/env.txt"
L70=benchmarks/configs/llama-3.1-70b
L405=benchmarks/configs/llama-3.1-405b
FP8_FLAGS="--quantization fp8 --kv-cache-dtype fp8_e4m3"

decode() {  # label model seconds extra...
    local label=$1 model=$2 seconds=$3
    shift 3
    timeout -k 10 "$seconds" python3 -m radixserve.bench.one_batch --model-path "$model" \
        --load-format dummy --dtype bfloat16 --tp-size "$TP" --batch-size 1 32 128 \
        --input-len 1024 --output-len 32 --overlap --cuda-graph-max-bs 128 \
        --max-total-tokens 300000 --log-level warning "$@" \
        --output-file "$OUT/one_batch_$label.jsonl" > "$OUT/one_batch_$label.log" 2>&1
    echo "   $label rc $?"
    quiet < "$OUT/one_batch_$label.log" | tail -5
}
offline() {  # label model seconds extra...
    local label=$1 model=$2 seconds=$3
    shift 3
    timeout -k 10 "$seconds" python3 -m radixserve.bench.offline --model-path "$model" \
        --load-format dummy --dtype bfloat16 --radix on --dataset-name random \
        --num-prompts "$PROMPTS" --random-input-len 1024 --random-output-len 1024 \
        --random-range-ratio 1.0 "$@" --output-file "$OUT/offline_$label.jsonl" \
        > "$OUT/offline_$label.log" 2>&1
    echo "   $label rc $?"
    quiet < "$OUT/offline_$label.log" | tail -4
}

if step decode70; then echo "== decode, 70B bf16, tp $TP"; decode 70b "$L70" 240; fi
if step offline70; then echo "== offline, 70B bf16, tp $TP"; offline 70b "$L70" 300 --tp-size "$TP"; fi
serve_and_bench() {  # label port rates server-flags...
    local label=$1 port=$2 rates=$3
    shift 3
    start_server "$port" "$OUT/server_$label.log" --load-format dummy --dtype bfloat16 \
        --skip-tokenizer-init "$@"
    for rate in $rates; do
        timeout -k 10 200 python3 -m radixserve.bench.serving --backend radixserve \
            --base-url "http://127.0.0.1:$port" --dataset-name random --num-prompts "$PROMPTS" \
            --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
            --request-rate "$rate" --output-file "$OUT/serving_$label.jsonl" \
            > "$OUT/serving_${label}_rate_$rate.log" 2>&1
        echo "   $label rate $rate rc $?: $(grep -E 'TTFT|ITL|throughput' \
            "$OUT/serving_${label}_rate_$rate.log" | head -4 | tr '\n' ' ')"
    done
    stop_server
}

if step serving70; then
    echo "== serving, 70B bf16, tp $TP"
    serve_and_bench 70b 30100 "4 8 16 inf" --model-path "$L70" --tp-size "$TP"
fi
if step decode405; then
    echo "== decode, 405B FP8 weights + FP8 KV, tp $TP"
    decode 405b "$L405" 420 $FP8_FLAGS
fi
if step offline405; then
    echo "== offline, 405B FP8 weights + FP8 KV, tp $TP"
    offline 405b "$L405" 480 $FP8_FLAGS --tp-size "$TP"
fi
if step tp_vs_dp; then
    echo "== Llama-3.1-8B served at rate inf: tp 8 against dp 8 (dp is a server-side flag)"
    serve_and_bench 8b_tp8 30101 inf --model-path benchmarks/configs/llama-3.1-8b --tp-size 8
    serve_and_bench 8b_dp8 30102 inf --model-path benchmarks/configs/llama-3.1-8b --dp-size 8
fi
