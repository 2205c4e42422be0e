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
# TP_STEPS="correctness one_batch offline" picks the steps (default: all). NCCL's multicast
# stays as the host sets it (NCCL_NVLS_ENABLE=0).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu_tp}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
MODEL=benchmarks/configs/llama-3.1-70b
STEPS="${TP_STEPS:-correctness one_batch offline}"
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
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
