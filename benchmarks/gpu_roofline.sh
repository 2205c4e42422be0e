#!/usr/bin/env bash
# Issue 17's table on one H200, from the repository root (Llama-3.1-8B shapes, bf16, dummy
# weights); logs under $OUT. One step per call keeps each under the device's 10-minute limit:
#   ROOF_STEPS="decode short long radix" bash benchmarks/gpu_roofline.sh   (~6 min)
#   ROOF_STEPS="offline http" bash benchmarks/gpu_roofline.sh              (~5 min)
# decode:  one static batch of 1 2 4 8 16 at context 1024, graphs + overlap
# offline: random 1024/1024 x 1000 through the Engine (retractions, recomputed tokens)
# offline_cohorts: the same with --admission-plan cohorts (the 1000 - 2 x 425 leftover admitted
#          first, so the last cohort does not run alone; benchmarks/admission_sim.py: -2.4 s)
# offline_mixed: the same with --enable-mixed-chunk (running requests keep decoding while the
#          next wave is prefilled; see PERFORMANCE, "where the bf16 offline run's time goes")
# http:    the same workload through the server, streaming, rate inf (ratio to offline); the
#          lent machines lack the server's packages: carry benchmarks/device_wheels.sh's .whl
#          (with py-spy among them, each http step also profiles the HTTP process)
# http_incremental: the same with --incremental-streaming-output (chunks carry only new ids)
# decode_ab: the decode step (batches ROOF_AB_BATCHES, default "1 8") with
#          RADIXSERVE_DECODE_CONFIG=$ROOF_AB_CONFIG and with the default, alternated twice: a
#          decode-attention variant's effect on whole steps (e.g. ROOF_AB_CONFIG=64,2,3,0,0,1,1,
#          the half-precision split default with early_kv)
# long:    4 prompts of 120,000 tokens, 32 out (long-context prefill)
# short:   4,000 requests of 128 in / 8 out (the scheduler's cost per request)
# short_mixed: the same with --enable-mixed-chunk: each interval's decode step of ~450 requests
#          rides in the prefill batch instead of reading the weights once more (session 8,
#          before prefills overlapped: 16.57 against 15.43 s; not re-measured since)
# short_profile: the same under py-spy (folded stacks in $OUT/short.folded: where the host time
#          goes; needs py-spy, e.g. from benchmarks/device_wheels.sh's .whl, on PATH)
# radix:   the generated-shared-prefix set, radix cache on and off
# profile: where a batch-8 decode step goes (torch.profiler, graphs) and the extend kernel on
#          8K chunks over 24K-120K prefixes, with its config sweep (ROOF_STEPS=profile, ~3 min)
# fusion:  a batch-1 decode layer's linears with and without the one-row fusions, bf16 and FP8
#          (benchmarks/gpu_row_fusion.py; ROOF_FUSION_ARGS="--sweep --write" re-sweeps their
#          configurations into the kernels' tables, ~4 min)
# early_ab: decode batch 1 and 8, bf16 then FP8 weights, with the decode-attention merge
#          launching o_proj early at batch 1 (RADIXSERVE_MERGE_EARLY_LAUNCH=1, the default) and
#          without it, alternated twice; the decode-attention and row-fusion GPU tests first
#          (~5 min)
# rope_ab: decode batch 1, bf16 then FP8 weights (then FP8 weights + KV), with rope and the K/V
#          store in the q|k|v GEMV's epilogue (RADIXSERVE_GEMV_ROPE=1, the default) and as their
#          own kernel (0), alternated twice (FP8 weights + KV once); the GEMV, rope and row-fusion
#          GPU tests first (~5 min)
# vendor_gap: the bf16 decode products' tiles re-swept at 2-64 rows (benchmarks/gpu_gemm_tune.py
#          --no-gemv; entries where cuBLAS won now keep the best tile), the tables packed into
#          $OUT/gemm_configs.tgz to bring back, then decode batch 2 / 4 / 8 / 16 with
#          RADIXSERVE_VENDOR_GAP_US=0 (the isolated sweep's pick) and =${ROOF_GAP_US:-3} (the
#          default: the tile where cuBLAS won by 3 us or less, so the kernel after it launches
#          early), alternated twice (~7 min; the sweep's budget ROOF_GAP_BUDGET, default 240 s).
#          The sweep replaces session 25's step-chosen tiles with its own entries;
#          ROOF_GAP_TUNE_ARGS=--in-chain times every candidate between two PDL kernels instead
# split_reduce_ab: the skinny GEMM's GPU tests, then decode batch 4 / 8 / 16 with split K summed
#          by atomics into a zeroed float32 buffer and a cast back (RADIXSERVE_SKINNY_SPLIT_REDUCE=
#          atomic, the default) and by each tile's last program (=last: one launch, with PDL),
#          alternated twice (~4 min; session 25's down tiles at 4-16 rows split K in 4)
# dataflow: the one-launch decode MLP (kernels/dataflow_mlp.py; on by default at 12-16 rows of
#          Llama-3.1-8B's MLP, its MEASURED_SHAPES entry):
#          its GPU tests, then its configuration sweep against the three kernels
#          (benchmarks/gpu_dataflow_mlp.py, Llama-3.1-8B's MLP; ROOF_DATAFLOW_ARGS, default
#          "--rows 16 12": the first row count swept in full, the five best at the others;
#          ~4 min)
# dataflow_ab: decode batches ROOF_AB_BATCHES (default "12 16") with RADIXSERVE_DATAFLOW_MLP=0
#          and =ROOF_DATAFLOW_CONFIG (default: the sweep's best at its first row count when
#          dataflow ran in the same call, else 1: the default, which runs only at a measured
#          shape's rows), alternated twice (~3 min)
# dataflow_profile: where a batch-16 decode step goes (benchmarks/gpu_profile_decode.py --graph)
#          with RADIXSERVE_DATAFLOW_MLP=0 and =ROOF_DATAFLOW_CONFIG (~3 min)
# rows_fusion: small-batch decode's fused products (kernels/fused_rows.py): their GPU tests, then
#          benchmarks/gpu_rows_fusion.py --write (each product swept at 2 rows; ROOF_ROWS_ARGS=
#          "--rows 2 4 8" for more; the fused layer against the unfused one; the winners go into
#          the board's tables, packed into $OUT/gemm_configs.tgz, the tables before it kept in
#          /tmp/tables_before; ~4 min)
# rows_ab: the decode step with the tables rows_fusion wrote against those before it,
#          alternated (ROOF_AB_ROUNDS, default "1 2"; batches ROOF_AB_BATCHES, default
#          "1 2 4 8 16"; ROOF_AB_TABLES names the old tables on a fresh machine)
# sustain: matmuls back to back for ROOF_SUSTAIN_SECONDS (default 60) with the clocks and
#          power sampled beside them (benchmarks/gpu_peaks.py --sustain), in each of
#          ROOF_SUSTAIN_DTYPES (default bf16; "bf16 fp8" adds _scaled_mm): the compute peak once
#          the board sits at its power limit, to set against the burst peaks the limits use
#          (session 19: bf16 665 against 796 TFLOP/s; the offline, short and long steps sample
#          the same telemetry)
# tune70: the decode products' sweep (benchmarks/gpu_gemm_tune.py --gemv-bf16) for Llama-3.1-70B's
#          shapes on one rank of tp ROOF_TUNE_TP (default "2 4 8"; bf16), written into the
#          kernels' tables and packed into $OUT/gemm_configs.tgz to bring back (~ROOF_TUNE_BUDGET
#          seconds per tp size, default 150; issue 17 asks for every 8B/70B shape swept)
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_roofline "${ROOF_STEPS:-decode short long radix offline http}"
MODEL="${ROOF_MODEL:-benchmarks/configs/llama-3.1-8b}"
PROMPTS="${ROOF_PROMPTS:-1000}"  # offline and http
COMMON=(--model-path "$MODEL" --load-format dummy --dtype bfloat16)

offline() {  # label seconds flags...
    local label=$1 seconds=$2
    shift 2
    telemetry_start "$OUT/telemetry_$label.csv"
    timeout -k 10 "$seconds" python3 -m radixserve.bench.offline "${COMMON[@]}" "$@" \
        --output-file "$OUT/offline_$label.jsonl" > "$OUT/offline_$label.log" 2>&1
    echo "   $label rc $?"
    telemetry_stop "$OUT/telemetry_$label.csv"
    grep -E -A2 '^radix ' "$OUT/offline_$label.log" | head -4
}
decode_batches() {  # name "batches": one static batch per size at context 1024, graphs +
    # overlap, into $OUT/name.{jsonl,log}, with the clocks and power sampled beside it
    telemetry_start "$OUT/telemetry_$1.csv"
    timeout -k 10 120 python3 -m radixserve.bench.one_batch "${COMMON[@]}" \
        --batch-size $2 --input-len 1024 --output-len 64 --overlap \
        --cuda-graph-max-bs 16 --max-total-tokens 100000 --log-level warning \
        --output-file "$OUT/$1.jsonl" > "$OUT/$1.log" 2>&1
    echo "   $1 ${RADIXSERVE_DECODE_CONFIG:-default decode config} rc $?"
    telemetry_stop "$OUT/telemetry_$1.csv"
    grep -E '^batch|^ +[0-9]+ ' "$OUT/$1.log"
}
env_ab() {  # VAR "values" "batches" kind: decode steps (context 1024, graphs + overlap) of
    # these batch sizes with VAR set to each value in turn; kind bf16, fp8 (weights) or fp8kv
    # (weights and KV); prints "kind VAR=value batch ms/step" per batch
    local var=$1 values=$2 batches=$3 kind=$4 value flags=()
    [ "$kind" = fp8 ] && flags=(--quantization fp8)
    [ "$kind" = fp8kv ] && flags=(--quantization fp8 --kv-cache-dtype fp8_e4m3)
    local max_bs=${batches##* }
    for value in $values; do
        env "$var=$value" timeout -k 10 100 python3 -m radixserve.bench.one_batch \
            "${COMMON[@]}" ${flags[@]+"${flags[@]}"} --batch-size $batches --input-len 1024 \
            --output-len 64 --overlap --cuda-graph-max-bs "$max_bs" --max-total-tokens 100000 \
            --log-level warning 2>&1 | grep -E '^ +[0-9]+ ' | tail -n "$(wc -w <<< "$batches")" \
            | awk -v k="$kind" -v v="$var=$value" -F'|' '{print "   " k, v, $1, $3}'
    done
}
if step decode; then
    echo "== decode"
    decode_batches decode "1 2 4 8 16"
fi
if step decode_ab; then
    echo "== decode, RADIXSERVE_DECODE_CONFIG=${ROOF_AB_CONFIG:?set ROOF_AB_CONFIG} vs default"
    for round in 1 2; do
        RADIXSERVE_DECODE_CONFIG="$ROOF_AB_CONFIG" decode_batches "decode_ab$round" \
            "${ROOF_AB_BATCHES:-1 8}"
        decode_batches "decode_default$round" "${ROOF_AB_BATCHES:-1 8}"
    done
fi
if step sustain; then
    for dtype in ${ROOF_SUSTAIN_DTYPES:-bf16}; do
        echo "== sustained $dtype matmul"
        telemetry_start "$OUT/telemetry_sustain_$dtype.csv"
        timeout -k 10 $(( ${ROOF_SUSTAIN_SECONDS:-60} + 60 )) python3 benchmarks/gpu_peaks.py \
            --sustain "${ROOF_SUSTAIN_SECONDS:-60}" --sustain-dtype "$dtype" \
            > "$OUT/sustain_$dtype.log" 2>&1
        echo "   rc $?"
        telemetry_stop "$OUT/telemetry_sustain_$dtype.csv"
        tail -1 "$OUT/sustain_$dtype.log"
    done
fi
if step short; then
    echo "== short requests"
    offline short 150 --radix on --dataset-name random --num-prompts 4000 \
        --random-input-len 128 --random-output-len 8 --random-range-ratio 1.0
fi
if step short_mixed; then
    echo "== short requests, decode tokens riding in the prefill batches (--enable-mixed-chunk)"
    offline short_mixed 150 --radix on --enable-mixed-chunk --dataset-name random \
        --num-prompts 4000 --random-input-len 128 --random-output-len 8 --random-range-ratio 1.0
fi
if step short_profile; then
    echo "== short requests under py-spy"
    if command -v py-spy > /dev/null; then
        timeout -k 10 200 py-spy record -r 200 -f raw -o "$OUT/short.folded" -- \
            python3 -m radixserve.bench.offline "${COMMON[@]}" --radix on --dataset-name random \
            --num-prompts 4000 --random-input-len 128 --random-output-len 8 \
            --random-range-ratio 1.0 > "$OUT/offline_short_profile.log" 2>&1
        echo "   rc $?"
        grep -E -A2 '^radix ' "$OUT/offline_short_profile.log" | head -4
    else
        echo "   py-spy not found: carry benchmarks/device_wheels.sh's .whl (see the header)"
    fi
fi
if step long; then
    echo "== long-context prefill"
    offline long 200 --radix on --dataset-name random --num-prompts 4 \
        --random-input-len 120000 --random-output-len 32 --random-range-ratio 1.0
fi
if step radix; then
    echo "== shared-prefix set"
    offline radix 200 --radix both --dataset-name generated-shared-prefix
fi
if step fusion; then
    echo "== fusion"
    timeout -k 10 330 python3 benchmarks/gpu_row_fusion.py ${ROOF_FUSION_ARGS:-} \
        > "$OUT/row_fusion.log" 2>&1
    echo "   rc $?"
    grep -E "^==|per layer|us;" "$OUT/row_fusion.log"
fi
if step early_ab; then
    echo "== decode, the merge's early launch at batch 1 on (1) and off (0)"
    timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider \
        tests/attention/test_triton_decode_attention.py tests/models/test_row_fusion.py \
        > "$OUT/early_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/early_tests.log")"
    for kind in bf16 fp8; do
        env_ab RADIXSERVE_MERGE_EARLY_LAUNCH "1 0 1 0" "1 8" "$kind"
    done
fi
if step rope_ab; then
    echo "== decode batch 1, rope + K/V store in the q|k|v GEMV (1) or a kernel of their own (0)"
    timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/layers/test_gemv_rope.py \
        tests/layers/test_fused_kernels.py tests/models/test_row_fusion.py \
        tests/attention/test_triton_decode_attention.py > "$OUT/rope_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/rope_tests.log")"
    env_ab RADIXSERVE_GEMV_ROPE "1 0 1 0" "1 1" bf16
    env_ab RADIXSERVE_GEMV_ROPE "1 0 1 0" "1 1" fp8
    env_ab RADIXSERVE_GEMV_ROPE "1 0" "1 1" fp8kv
fi
if step vendor_gap; then
    echo "== vendor gap: the tiles re-swept (kept where cuBLAS won), then decode A/B"
    timeout -k 10 $(( ${ROOF_GAP_BUDGET:-240} + 60 )) python3 benchmarks/gpu_gemm_tune.py \
        --kinds bf16 --no-gemv --budget "${ROOF_GAP_BUDGET:-240}" ${ROOF_GAP_TUNE_ARGS:-} \
        > "$OUT/vendor_gap_tune.log" 2>&1
    echo "   tune rc $?"
    grep -E '^==|M=(2|4|8|16) ' "$OUT/vendor_gap_tune.log" | cut -c1-160
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
    gap=${ROOF_GAP_US:-3}
    env_ab RADIXSERVE_VENDOR_GAP_US "0 $gap 0 $gap" "2 4 8 16" bf16
fi
if step split_reduce_ab; then
    echo "== split K: atomics + cast (atomic) against the last program's sum (last)"
    timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/layers/test_skinny_gemm.py \
        > "$OUT/split_reduce_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/split_reduce_tests.log")"
    env_ab RADIXSERVE_SKINNY_SPLIT_REDUCE "atomic last atomic last" "4 8 16" bf16
fi
if step dataflow; then
    echo "== the decode MLP in one launch (kernels/dataflow_mlp.py) against three kernels"
    timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/layers/test_dataflow_mlp.py \
        > "$OUT/dataflow_tests.log" 2>&1
    rc=$?
    echo "   tests rc $rc: $(tail -1 "$OUT/dataflow_tests.log")"
    [ $rc = 0 ] && timeout -k 10 "${ROOF_DATAFLOW_SWEEP_S:-300}" python3 \
        benchmarks/gpu_dataflow_mlp.py --best-out "$OUT/dataflow_best.txt" \
        ${ROOF_DATAFLOW_ARGS:---rows 16 12} 2>&1 | tee "$OUT/dataflow.log" | grep -E "^H|M="
fi
if step dataflow_ab; then
    best=${ROOF_DATAFLOW_CONFIG:-$(cat "$OUT/dataflow_best.txt" 2>/dev/null || echo 1)}
    echo "== decode, the MLP in one launch (RADIXSERVE_DATAFLOW_MLP=$best) against three kernels (0)"
    env_ab RADIXSERVE_DATAFLOW_MLP "0 $best 0 $best" "${ROOF_AB_BATCHES:-12 16}" bf16
fi
if step dataflow_profile; then
    best=${ROOF_DATAFLOW_CONFIG:-$(cat "$OUT/dataflow_best.txt" 2>/dev/null || echo 1)}
    for value in 0 "$best"; do
        echo "== where a batch-16 decode step goes, RADIXSERVE_DATAFLOW_MLP=$value"
        RADIXSERVE_DATAFLOW_MLP=$value timeout -k 10 150 python3 benchmarks/gpu_profile_decode.py \
            --batch 16 --graph > "$OUT/dataflow_profile_$value.log" 2>&1
        echo "   rc $?"
        grep -v -E "Warning|warn" "$OUT/dataflow_profile_$value.log" | tail -25
    done
fi
if step rows_fusion; then
    echo "== rows fusion: GPU tests, the 2-8-row sweep (written into the tables), decode A/B"
    timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/models/test_rows_fusion.py \
        tests/models/test_row_fusion.py > "$OUT/rows_fusion_tests.log" 2>&1
    echo "   tests rc $?: $(tail -1 "$OUT/rows_fusion_tests.log")"
    rm -rf /tmp/tables_before && cp -r radixserve/layers/kernels/gemm_configs /tmp/tables_before
    timeout -k 10 420 python3 benchmarks/gpu_rows_fusion.py --write ${ROOF_ROWS_ARGS:-} \
        > "$OUT/rows_fusion.log" 2>&1
    echo "   sweep rc $?"
    grep -E "^==|M=" "$OUT/rows_fusion.log"
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
fi
if step rows_ab; then
    echo "== decode, the tables rows_fusion wrote vs those before it"
    for round in ${ROOF_AB_ROUNDS:-1 2}; do
        decode_batches "rows_new$round" "${ROOF_AB_BATCHES:-1 2 4 8 16}"
        RADIXSERVE_GEMM_CONFIG_DIR="${ROOF_AB_TABLES:-/tmp/tables_before}" \
            decode_batches "rows_old$round" "${ROOF_AB_BATCHES:-1 2 4 8 16}"
    done
fi
if step profile; then
    echo "== profile"
    timeout -k 10 150 python3 benchmarks/gpu_profile_decode.py --batch 8 --graph \
        > "$OUT/profile_decode_b8.log" 2>&1
    echo "   decode b8 rc $?"
    tail -25 "$OUT/profile_decode_b8.log"
    timeout -k 10 200 python3 benchmarks/gpu_kernels.py --only extend --long --sweep \
        > "$OUT/extend_long.log" 2>&1
    echo "   extend rc $?"
    grep -E "prefix|x4096|x1024" "$OUT/extend_long.log" | head -40
fi
if step offline; then
    echo "== offline 1024/1024 x 1000"
    offline main 200 --radix on --dataset-name random --num-prompts "$PROMPTS" \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0
fi
if step offline_cohorts; then
    echo "== offline 1024/1024 x 1000, --admission-plan cohorts"
    offline cohorts 200 --radix on --admission-plan cohorts --dataset-name random \
        --num-prompts "$PROMPTS" --random-input-len 1024 --random-output-len 1024 \
        --random-range-ratio 1.0
fi
if step offline_mixed; then
    echo "== offline 1024/1024 x 1000, mixed prefill + decode passes"
    offline mixed 200 --radix on --enable-mixed-chunk --dataset-name random \
        --num-prompts "$PROMPTS" --random-input-len 1024 --random-output-len 1024 \
        --random-range-ratio 1.0
fi
http_run() {  # label server-flags...: the offline workload through /generate, streaming
    local label=$1
    shift
    echo "== HTTP streaming, same workload ($label: ${*:-default flags})"
    start_server 30200 "$OUT/server_$label.log" "${COMMON[@]}" --skip-tokenizer-init "$@"
    # where the HTTP process's time goes (py-spy, when the .whl carried it: see the header)
    if command -v py-spy > /dev/null; then
        py-spy record -p "$SERVER_PID" -d 60 -r 100 -f raw -o "$OUT/http_prof_$label.txt" \
            > /dev/null 2>&1 &
    fi
    timeout -k 10 300 python3 -m radixserve.bench.serving --backend radixserve \
        --base-url http://127.0.0.1:30200 --dataset-name random --num-prompts "$PROMPTS" \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
        --request-rate inf --output-file "$OUT/http_$label.jsonl" > "$OUT/http_$label.log" 2>&1
    echo "   rc $?: $(grep -E 'Duration|Output token throughput|Mean (TTFT|ITL)' \
        "$OUT/http_$label.log" | tr -s ' ' | tr '\n' ' ')"
    # CPU seconds each server process used (HTTP, detokenizer, scheduler): which one is busy
    ps -o pid,ppid,time,args --ppid "$SERVER_PID" -p "$SERVER_PID" | cut -c1-110 \
        | tee "$OUT/http_cpu_$label.txt"
    stop_server
}
if step http; then
    # each chunk of a native /generate stream carries all output ids so far (SGLang's default)
    http_run cumulative
fi
if step http_incremental; then  # only the new ids per chunk (--incremental-streaming-output)
    http_run incremental --incremental-streaming-output
fi
if step tune70; then
    for tp in ${ROOF_TUNE_TP:-2 4 8}; do
        echo "== tune: Llama-3.1-70B, one rank of tp $tp, bf16"
        timeout -k 10 $(( ${ROOF_TUNE_BUDGET:-150} + 60 )) python3 benchmarks/gpu_gemm_tune.py \
            --model-path benchmarks/configs/llama-3.1-70b --tp-size "$tp" --kinds bf16 \
            --gemv-bf16 --budget "${ROOF_TUNE_BUDGET:-150}" > "$OUT/tune70_tp$tp.log" 2>&1
        echo "   rc $?"
        grep -E "^==|M=" "$OUT/tune70_tp$tp.log" | cut -c1-160
    done
    tar czf "$OUT/gemm_configs.tgz" -C radixserve/layers/kernels gemm_configs
fi
