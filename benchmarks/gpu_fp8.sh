#!/usr/bin/env bash
# FP8 and decode-sized GEMMs on one H200 (issues 13 and 17), from the repository root; logs
# under $OUT.
#   FP8_STEPS="tests tune mma codes decode offline" bash benchmarks/gpu_fp8.sh
# tests:   FP8 and small-M kernels against references on the GPU (GEMV, skinny GEMM, FP8-weight
#          GEMM, FP8 KV through the Triton decode/extend kernels and the fused rope + store)
# tune:    benchmarks/gpu_gemm_tune.py: sweep the GEMV / skinny GEMM per Llama-3.1-8B shape and
#          row count, write radixserve/layers/kernels/gemm_configs/ (and $OUT/gemm_configs.tgz);
#          FP8_TUNE_ARGS passes more flags (e.g. "--kinds fp8 --no-gemv")
# mma:     benchmarks/gpu_fp8_mma.py: the FP8 tensor-core kernel for decode rows against the
#          GEMV / skinny GEMM it would replace, per shape, row count and one-row fusion
#          (FP8_MMA_ARGS, default "--write --budget 240": winners into the tables, and
#          $OUT/gemm_configs.tgz)
# codes:   benchmarks/gpu_fp8_mma.py --codes: the same kernel on activation codes (what
#          DecoderLayer.forward_fp8_rows gives it at 2-128 rows) against what the model runs
#          without them; winners into the tables as "codes" (FP8_CODES_ARGS, default
#          "--rows 8 16 --write --budget 120"; after `mma`, whose entries it compares with;
#          "--rows 32 64 128 --write --budget 240" sweeps the 17-128-row tiles)
#          Another model's shapes on one tensor-parallel rank: the three steps' ARGS take
#          --model-path / --tp-size, e.g. Llama-3.1-405B at tp 8 (issue 18's FP8 run, one GPU):
#          FP8_STEPS="tune mma codes" M="--model-path benchmarks/configs/llama-3.1-405b
#          --tp-size 8"; FP8_TUNE_ARGS="$M --kinds fp8" FP8_MMA_ARGS="$M --write --budget 150"
#          FP8_CODES_ARGS="$M --rows 8 16 32 64 128 --write --budget 150"
# decode:  Llama-3.1-8B shapes, dummy weights, one static batch of 1 / 8 / 32 (FP8_DECODE_BATCHES)
#          at context 1024, graphs + overlap: bf16, FP8 weights quantised at load
#          (--quantization fp8), and FP8 weights + FP8 KV cache
# tables_ab: the w8kv8 decode step with the kernels' tables from FP8_AB_TABLES (a folder of
#          gemm_configs/*.json, e.g. an earlier commit's: `git archive COMMIT
#          radixserve/layers/kernels/gemm_configs | tar x -C ab_tables`, then carry it) and with
#          the package's, alternated twice (FP8_DECODE_BATCHES)
# attn:    decode attention over an FP8 pool at the FP8 offline run's batch (256 and 862 at
#          context 1536): the config sweep, and the rate of only reading K/V in the same
#          pattern (1, 2, 4 KV heads per program; FP8 and bf16), over random slots and then
#          contiguous ones (benchmarks/gpu_kernels.py --only decode --fp8 --gather
#          [--contiguous]); the kernel tests first (~4 min). FP8_ATTN_LAYOUTS (default "random
#          contiguous") picks the slot layouts, FP8_ATTN_ARGS adds flags
# attn_ab: the FP8 KV offline run (as `offline` kv8) with the decode config that the attn step's
#          log (or FP8_ATTN_LOG) found fastest at batch 862 (RADIXSERVE_DECODE_CONFIG), and with
#          the default, when the best is >= 3% faster than the default
# offline: random 1024/1024 x FP8_PROMPTS (default 1000): bf16, FP8 KV only, FP8 weights + KV
#          (FP8_OFFLINE_MODES picks a subset; kv8_cohorts / w8kv8_cohorts: the same with
#          --admission-plan cohorts, the leftover admitted first); FP8_OFFLINE_ARGS adds flags to
#          each run, FP8_OFFLINE_SUFFIX to its label (e.g. "--cuda-graph-max-bs 1024" and _g1024)
# fast_accum: _scaled_mm's rate and error with and without use_fast_accum at the 8B shapes
#          (benchmarks/gpu_scaled_mm.py, ~1 min)
# w8kv8_ab: FP8 W + KV offline once per word of FP8_AB_RUNS, in that order (~95 s each):
#          codes (the default: the norms' codes, fast accumulation), pass
#          (RADIXSERVE_FP8_PREQUANT_BATCHES=0), exact (RADIXSERVE_FP8_FAST_ACCUM=0: _scaled_mm
#          promotes its accumulator); e.g. FP8_AB_RUNS="exact codes pass exact codes pass"
#          (session 20's prequant_ab step was FP8_AB_RUNS="codes pass codes pass")
# logits_ab: the decode graphs' logits in bf16 (the default since session 22) against the
#          float32 buffer (RADIXSERVE_GRAPH_BF16_LOGITS=0), FP8 W + KV decode steps at
#          FP8_LOGITS_BATCHES (default "256 896", context 1024), alternated twice; the graph
#          runner's GPU tests first, with the float32 buffer (the default's run in `tests`)
# peaks:   benchmarks/gpu_peaks.py --matmul-only (50 ms bursts: FP8 already power-held) and
#          --full-clock (~4 ms graphs after idle seconds: the rate at the full clock), ~2 min
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_fp8 "${FP8_STEPS:-tests tune mma codes decode offline}"
MODEL=benchmarks/configs/llama-3.1-8b

if step tests; then
    echo "== tests"
    timeout -k 10 "${FP8_TEST_SECONDS:-300}" python3 -m pytest -q -x tests/layers/test_fp8_gemm.py \
        tests/layers/test_skinny_gemm.py tests/layers/test_gemv.py tests/mem/test_fp8_kv.py \
        tests/attention/test_fp8_kv_kernels.py tests/layers/test_fp8_mma_rows.py \
        tests/models/test_fp8_rows.py > "$OUT/tests.log" 2>&1
    echo "   rc $?: $(tail -1 "$OUT/tests.log")"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -8
fi
if step attn; then
    echo "== decode attention over FP8 KV"
    timeout -k 10 150 python3 -m pytest -q -x tests/attention/test_fp8_kv_kernels.py \
        tests/attention/test_triton_decode_attention.py > "$OUT/attn_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/attn_tests.log")"
    grep -E "^(FAILED|E  )" "$OUT/attn_tests.log" | head -8
    for layout in ${FP8_ATTN_LAYOUTS:-random contiguous}; do
        flag=""
        [ "$layout" = contiguous ] && flag=--contiguous
        timeout -k 10 240 python3 benchmarks/gpu_kernels.py --only decode --fp8 --gather $flag \
            ${FP8_ATTN_ARGS:-} > "$OUT/attn_$layout.log" 2>&1
        echo "   $layout slots rc $?"
        grep -E "^decode|not run" "$OUT/attn_$layout.log"
    done
fi
if step tune; then
    echo "== tune"
    timeout -k 10 "${FP8_TUNE_SECONDS:-300}" python3 benchmarks/gpu_gemm_tune.py \
        --budget "${FP8_TUNE_BUDGET:-240}" ${FP8_TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
    echo "   rc $?"
    grep -E "^==|M=" "$OUT/tune.log" | cut -c1-150
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
fi
if step mma; then
    echo "== mma"
    timeout -k 10 "${FP8_MMA_SECONDS:-320}" python3 benchmarks/gpu_fp8_mma.py \
        ${FP8_MMA_ARGS:---write --budget 240} > "$OUT/mma.log" 2>&1
    echo "   rc $?"
    grep -E "^ +M=" "$OUT/mma.log" | cut -c1-220
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
fi
if step codes; then
    echo "== codes"
    timeout -k 10 "${FP8_CODES_SECONDS:-180}" python3 benchmarks/gpu_fp8_mma.py --codes \
        ${FP8_CODES_ARGS:---rows 8 16 --write --budget 120} > "$OUT/codes.log" 2>&1
    echo "   rc $?"
    grep -E "codes M=" "$OUT/codes.log" | cut -c1-200
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
fi
one_batch() {  # label, extra flags...
    local label=$1 batches="${FP8_DECODE_BATCHES:-1 8 32}" largest
    shift
    largest=$(echo $batches | tr ' ' '\n' | sort -n | tail -1)
    timeout -k 10 "${FP8_DECODE_SECONDS:-100}" python3 -m radixserve.bench.one_batch \
        --model-path "$MODEL" --load-format dummy --dtype bfloat16 \
        --batch-size $batches --input-len 1024 --output-len 32 --overlap \
        --cuda-graph-max-bs "$largest" \
        --max-total-tokens $(( largest * 1100 > 100000 ? largest * 1100 : 100000 )) \
        --log-level warning "$@" \
        --output-file "$OUT/one_batch_$label.jsonl" > "$OUT/one_batch_$label.log" 2>&1
    echo "   $label rc $?"
    # the final table: its header and one row per batch
    quiet < "$OUT/one_batch_$label.log" | tail -n $(( $(echo $batches | wc -w) + 1 ))
}
if step decode; then
    echo "== decode"
    MODES="${FP8_DECODE_MODES:-bf16 w8 w8kv8}"
    case " $MODES " in *" bf16 "*) one_batch bf16 ;; esac
    case " $MODES " in *" w8 "*) one_batch w8 --quantization fp8 ;; esac
    case " $MODES " in *" w8kv8 "*) one_batch w8kv8 --quantization fp8 --kv-cache-dtype fp8_e4m3 ;; esac
fi
if step tables_ab; then
    echo "== w8kv8 decode, tables of ${FP8_AB_TABLES:?set FP8_AB_TABLES} vs the package's"
    for round in 1 2; do
        RADIXSERVE_GEMM_CONFIG_DIR="$(cd "$FP8_AB_TABLES" && pwd)" \
            one_batch "w8kv8_ab$round" --quantization fp8 --kv-cache-dtype fp8_e4m3
        one_batch "w8kv8_pkg$round" --quantization fp8 --kv-cache-dtype fp8_e4m3
    done
fi
offline() {  # label, extra flags... (then FP8_OFFLINE_ARGS; FP8_OFFLINE_SUFFIX ends the label)
    local label=$1${FP8_OFFLINE_SUFFIX:-}
    shift
    telemetry_start "$OUT/telemetry_$label.csv"
    timeout -k 10 "${FP8_OFFLINE_SECONDS:-200}" python3 -m radixserve.bench.offline \
        --model-path "$MODEL" --load-format dummy --dtype bfloat16 --radix on \
        --dataset-name random --num-prompts "${FP8_PROMPTS:-1000}" --random-input-len 1024 \
        --random-output-len 1024 --random-range-ratio 1.0 "$@" ${FP8_OFFLINE_ARGS:-} \
        --output-file "$OUT/offline_$label.jsonl" > "$OUT/offline_$label.log" 2>&1
    echo "   $label rc $?"
    telemetry_stop "$OUT/telemetry_$label.csv"
    quiet < "$OUT/offline_$label.log" | grep -E 'KV cache:|^ +on|ratio' | tail -3
}
if step attn_ab; then
    echo "== FP8 KV offline with the fastest decode config at batch 862"
    best=$(python3 benchmarks/decode_config_pick.py "${FP8_ATTN_LOG:-$OUT/attn_random.log}" \
        862 0.97)
    echo "   pick: ${best:-none}"
    if [ -n "$best" ]; then
        export RADIXSERVE_DECODE_CONFIG="$best"
        offline kv8_picked --kv-cache-dtype fp8_e4m3
        unset RADIXSERVE_DECODE_CONFIG
        offline kv8 --kv-cache-dtype fp8_e4m3
    fi
fi
if step offline; then
    echo "== offline"
    MODES="${FP8_OFFLINE_MODES:-bf16 kv8 w8kv8}"
    case " $MODES " in *" bf16 "*) offline bf16 ;; esac
    case " $MODES " in *" kv8 "*) offline kv8 --kv-cache-dtype fp8_e4m3 ;; esac
    case " $MODES " in *" w8kv8 "*) offline w8kv8 --quantization fp8 --kv-cache-dtype fp8_e4m3 ;; esac
    case " $MODES " in *" kv8_cohorts "*)
        offline kv8_cohorts --kv-cache-dtype fp8_e4m3 --admission-plan cohorts ;; esac
    case " $MODES " in *" w8kv8_cohorts "*)
        offline w8kv8_cohorts --quantization fp8 --kv-cache-dtype fp8_e4m3 \
            --admission-plan cohorts ;; esac
fi
if step fast_accum; then
    echo "== _scaled_mm with use_fast_accum"
    timeout -k 10 150 python3 benchmarks/gpu_scaled_mm.py > "$OUT/scaled_mm.log" 2>&1
    echo "   rc $?"
    cat "$OUT/scaled_mm.log"
fi
if step w8kv8_ab; then
    echo "== FP8 W + KV offline: ${FP8_AB_RUNS:?set FP8_AB_RUNS}"
    n=0
    for variant in $FP8_AB_RUNS; do
        n=$((n + 1))
        case $variant in
            codes) env_var=RADIXSERVE_FP8_PREQUANT_BATCHES=1 ;;
            pass) env_var=RADIXSERVE_FP8_PREQUANT_BATCHES=0 ;;
            exact) env_var=RADIXSERVE_FP8_FAST_ACCUM=0 ;;
            *) echo "   unknown variant $variant"; continue ;;
        esac
        export "$env_var"
        offline "w8kv8_$variant$n" --quantization fp8 --kv-cache-dtype fp8_e4m3
        unset "${env_var%%=*}"
    done
fi
if step logits_ab; then
    echo "== decode graphs' logits: bf16 (default) vs float32"
    RADIXSERVE_GRAPH_BF16_LOGITS=0 timeout -k 10 150 python3 -m pytest -q tests/executor/test_cuda_graph_runner.py \
        tests/layers/test_logits.py > "$OUT/logits_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/logits_tests.log")"
    grep -E "^(FAILED|E  )" "$OUT/logits_tests.log" | head -8
    for round in 1 2; do
        RADIXSERVE_GRAPH_BF16_LOGITS=0 FP8_DECODE_BATCHES="${FP8_LOGITS_BATCHES:-256 896}" \
            FP8_DECODE_SECONDS="${FP8_DECODE_SECONDS:-240}" one_batch \
            "w8kv8_fp32_logits$round" --quantization fp8 --kv-cache-dtype fp8_e4m3
        FP8_DECODE_BATCHES="${FP8_LOGITS_BATCHES:-256 896}" \
            FP8_DECODE_SECONDS="${FP8_DECODE_SECONDS:-240}" one_batch \
            "w8kv8_bf16_logits$round" --quantization fp8 --kv-cache-dtype fp8_e4m3
    done
fi
if step peaks; then
    echo "== matmul peaks: bursts, then at the full clock"
    timeout -k 10 60 python3 benchmarks/gpu_peaks.py --matmul-only 2>&1 | quiet
    timeout -k 10 150 python3 benchmarks/gpu_peaks.py --full-clock 2>&1 | quiet
fi
