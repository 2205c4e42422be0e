#!/usr/bin/env bash
# MoE and MLA on one H200 (issue 12), from the repository root; logs under $OUT:
#
#   MOE_STEPS="tests correctness kernels" bash benchmarks/gpu_moe.sh      # one call
#   MOE_STEPS="decode offline" bash benchmarks/gpu_moe.sh                 # another
#   MOE_STEPS="kernels board_ab" bash benchmarks/gpu_moe.sh               # a board's own tables
#   MOE_STEPS="tests gemv gemv_ab" bash benchmarks/gpu_moe.sh             # the decode GEMVs
#
# tests:       pytest of the fused-MoE and MLA kernel tests on the GPU
# correctness: tiny Mixtral / Qwen3-MoE / DeepSeek-V2 / V3 (MLA) checkpoints, torch_native, triton,
#              triton + CUDA graphs vs transformers, bf16 and fp32 (gpu_correctness.py)
# kernels:     benchmarks/gpu_moe.py --sweep (MLA decode kernel, fused-MoE sweep + figures)
# decode:      one static batch at context 1024, dummy bf16 weights, graphs + overlap:
#              Mixtral-8x7B 1/32/128, Qwen3-30B-A3B 1/32/128, DeepSeek-V2-Lite 1/64/256
# offline:     random 1024/1024 x MOE_OFFLINE_PROMPTS (default 500), Mixtral and V2-Lite
# board_ab:    after `kernels` in the same call: decode one static batch of Qwen3-30B-A3B
#              (1 / 32 / 128) and DeepSeek-V2-Lite (1 / 64 / 256) with the block sizes this
#              board reads now and with the sweep's (copied into moe_configs/boards/BOARD/, or
#              the folder itself on the reference board; kernels/board_tables.py), alternated
#              per model; the sweep's tables stay in place, to copy back from $OUT/moe_board
#              (on an H100 80GB Mixtral's 93 GB of bf16 weights do not fit, so it is left out)
# gemv:        benchmarks/gpu_moe_gemv.py --write (MOE_GEMV_KINDS, default bf16; MOE_GEMV_MODELS,
#              default all three): the
#              routed experts' decode GEMVs (kernels/moe_gemv.py) swept against the grouped path
#              at 1-16 tokens; the table goes where this board reads it, and to $OUT/moe_configs
# gemv_ab:     decode one static batch (1 / 2 / 4 / 8 / 16) of Qwen3-30B-A3B and DeepSeek-V2-Lite
#              with RADIXSERVE_MOE_GEMV=0 then 1 (after `gemv` in the same call: its tables)
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_moe "${MOE_STEPS:-tests correctness kernels decode offline}"

if step tests; then
    echo "== tests"
    timeout -k 10 240 python3 -m pytest -q -x tests/layers/test_fused_moe.py \
        tests/layers/test_moe_gemv.py tests/attention/test_mla_triton.py > "$OUT/tests.log" 2>&1
    echo "   rc $?: $(tail -1 "$OUT/tests.log")"
fi
if step correctness; then
    echo "== correctness"
    checkpoints=${MOE_CORR_CHECKPOINTS:-mixtral-moe qwen3-moe deepseek-mla deepseek-v3}
    timeout -k 10 "${MOE_CORR_SECONDS:-200}" python3 benchmarks/gpu_correctness.py \
        --checkpoints $checkpoints --new-tokens 24 \
        --time-budget $(( ${MOE_CORR_SECONDS:-200} - 30 )) --out "$OUT" > "$OUT/correctness.log" 2>&1
    echo "   rc $?: $(grep '^correctness:' "$OUT/correctness.log" || tail -2 "$OUT/correctness.log")"
    grep -E '^(FAIL|TIE) ' "$OUT/correctness.log" | cut -c1-220 | head -12
fi
if step kernels; then
    echo "== kernels"
    timeout -k 10 "${MOE_KERNEL_SECONDS:-200}" python3 benchmarks/gpu_moe.py --sweep \
        --time-budget $(( ${MOE_KERNEL_SECONDS:-200} - 60 )) --out "$OUT" > "$OUT/kernels.log" 2>&1
    echo "   rc $?"
    grep -E '^(moe|mla|sweep)' "$OUT/kernels.log" | cut -c1-200
    tail -3 "$OUT/kernels.log" | quiet
fi
decode() {  # name batch sizes...
    local name=$1
    shift
    timeout -k 10 "${MOE_DECODE_SECONDS:-140}" python3 -m radixserve.bench.one_batch \
        --model-path "benchmarks/configs/$name" --load-format dummy --dtype bfloat16 \
        --batch-size "$@" --input-len 1024 --output-len 32 --overlap --context-length 4096 \
        --cuda-graph-max-bs "${MOE_GRAPH_BS:-256}" --max-total-tokens "${MOE_MAX_TOKENS:-300000}" \
        --log-level warning \
        --output-file "$OUT/one_batch_$name.jsonl" > "$OUT/one_batch_$name.log" 2>&1
    echo "   $name rc $?"
    quiet < "$OUT/one_batch_$name.log" | tail -5
}
if step decode; then
    echo "== decode"
    # 93 GB of weights: a KV pool of 140K tokens (18 GB) leaves room for a 131K-token prefill
    MOE_GRAPH_BS=128 MOE_MAX_TOKENS=140000 decode mixtral-8x7b 1 32 128
    MOE_GRAPH_BS=128 decode qwen3-30b-a3b 1 32 128
    decode deepseek-v2-lite 1 64 256
fi
offline() {
    timeout -k 10 "${MOE_OFFLINE_SECONDS:-240}" python3 -m radixserve.bench.offline \
        --model-path "benchmarks/configs/$1" --load-format dummy --dtype bfloat16 --radix on \
        --context-length 4096 --dataset-name random --num-prompts "${MOE_OFFLINE_PROMPTS:-500}" --cuda-graph-max-bs 256 \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
        --output-file "$OUT/offline_$1.jsonl" > "$OUT/offline_$1.log" 2>&1
    echo "   $1 rc $?"
    quiet < "$OUT/offline_$1.log" | grep -v -E 'Decode batch|Prefill batch' | tail -6
    grep -E 'Decode batch' "$OUT/offline_$1.log" | tail -2
}
if step offline; then
    echo "== offline"
    offline mixtral-8x7b
    offline deepseek-v2-lite
fi
if step board_ab; then
    echo "== decode with this board's fused-MoE block sizes: before and after the sweep"
    read -r BOARD DEST < <(python3 -c "from radixserve.layers.kernels import board_tables as b
from radixserve.layers.kernels import fused_moe as f
print(b.current_board(), b.board_dir(f.CONFIG_DIR, b.current_board()))")
    rm -rf "$OUT/moe_board" /tmp/moe_before && mkdir -p "$OUT/moe_board" "$DEST"
    cp "$OUT"/moe_configs/*.json "$OUT/moe_board"/ && cp -r "$DEST" /tmp/moe_before
    echo "   board $BOARD, tables into $DEST: $(ls "$OUT/moe_board" | wc -l) files"
    for name in qwen3-30b-a3b deepseek-v2-lite; do
        batches="1 32 128"; [ "$name" = deepseek-v2-lite ] && batches="1 64 256"
        for tables in before sweep; do
            rm -rf "$DEST" && cp -r /tmp/moe_before "$DEST"
            [ "$tables" = sweep ] && cp "$OUT"/moe_board/*.json "$DEST"/
            decode "$name" $batches > "$OUT/board_ab_${tables}_$name.txt"
            echo "   $tables:"; cat "$OUT/board_ab_${tables}_$name.txt"
        done
    done
fi
if step gemv; then
    echo "== the MoE decode GEMVs swept against the grouped path"
    timeout -k 10 "${MOE_GEMV_SECONDS:-330}" python3 benchmarks/gpu_moe_gemv.py --write \
        --kinds ${MOE_GEMV_KINDS:-bf16} ${MOE_GEMV_MODELS:+--models $MOE_GEMV_MODELS} \
        --time-budget $(( ${MOE_GEMV_SECONDS:-330} - 30 )) \
        --out "$OUT" > "$OUT/gemv.log" 2>&1
    echo "   rc $?"
    grep -E '^(gemv|  wrote)' "$OUT/gemv.log" | cut -c1-300
    tail -3 "$OUT/gemv.log" | quiet
fi
if step gemv_ab; then
    echo "== decode with the MoE GEMVs off (0) and on (1)"
    for name in qwen3-30b-a3b deepseek-v2-lite; do
        for gemv in 0 1; do
            RADIXSERVE_MOE_GEMV=$gemv MOE_GRAPH_BS=16 MOE_MAX_TOKENS=60000 \
                decode "$name" 1 2 4 8 16 > "$OUT/gemv_ab_${gemv}_$name.txt"
            echo "   RADIXSERVE_MOE_GEMV=$gemv:"; cat "$OUT/gemv_ab_${gemv}_$name.txt"
        done
    done
fi
