#!/usr/bin/env bash
# The GPU variants that are in the code but off until the H200 has timed them (session 11),
# from the repository root; logs under $OUT. One call (its timeouts add to ~9 min):
#   CAND_STEPS="tests kernels codes" bash benchmarks/gpu_candidates.sh
# tests:   the kernels against their references on the GPU (bf16 included): decode attention
#          through CUDA-graph replays and over an FP8 pool, the FP8 rows on activations
#          quantised beforehand
# kernels: decode attention per layer, batch 1-16 at context 1024 and over an e4m3 pool at
#          batch 256 / 862, context 1536
# codes:   the FP8 tensor-core rows on pre-quantised activations next to the incumbents and
#          next to per_token_quant alone (benchmarks/gpu_fp8_mma.py --codes)
# (The fused decode merge and e4m3 q . k were timed slower in session 12 and removed.)
# Where one wins, make it the default and record the figures in docs/PERFORMANCE.md.
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh gpu_candidates "${CAND_STEPS:-tests kernels codes}"

if step tests; then
    echo "== tests"
    timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider \
        "tests/attention/test_triton_backend.py::test_real_cuda_graph_replay_tracks_new_lengths" \
        tests/attention/test_fp8_kv_kernels.py tests/attention/test_triton_decode_attention.py \
        tests/layers/test_fp8_mma_rows.py > "$OUT/tests.log" 2>&1
    echo "   rc $?: $(tail -1 "$OUT/tests.log")"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -8
fi
if step kernels; then
    echo "== decode attention kernels"
    timeout -k 10 120 python3 benchmarks/gpu_kernels.py --only decode --small \
        > "$OUT/kernels_small.log" 2>&1
    echo "   small rc $?"; grep -E "^decode" "$OUT/kernels_small.log"
    timeout -k 10 120 python3 benchmarks/gpu_kernels.py --only decode --fp8 \
        > "$OUT/kernels_fp8.log" 2>&1
    echo "   fp8 rc $?"; grep -E "^decode" "$OUT/kernels_fp8.log"
fi
if step codes; then
    echo "== FP8 rows on quantised activations"
    timeout -k 10 130 python3 benchmarks/gpu_fp8_mma.py --codes --rows 1 8 --budget 90 \
        > "$OUT/codes.log" 2>&1
    echo "   rc $?"; grep -E "codes M=" "$OUT/codes.log" | cut -c1-200
fi
