#!/usr/bin/env bash
# The whole GPU check in one call (KERNEL_MAX caps the kernel tests, default 180 s, CORR_MAX the
# correctness step, default 170 s), from the repository root:
#
#   bash benchmarks/gpu_suite.sh            # logs under $OUT (default: out/gpu_suite)
#
# a. kernel tests:  pytest -m gpu over tests/attention tests/layers tests/executor (real shapes)
# (native_kernels, not in the default steps: GPU_SUITE_STEPS=native_kernels runs the cases marked
#  `kernel` natively, those that CI runs in the Triton interpreter, ~350 of them; -m gpu misses
#  them, and an interpreter pass says nothing of the compiled kernel)
# b. correctness:   benchmarks/gpu_correctness.py (tiny random Llamas: torch_native, triton,
#                   triton + CUDA graphs vs transformers, bf16 and fp32)
# c. figures:       benchmarks/gpu_figures.py (Llama-3.1-8B shapes, bf16, dummy weights)
# It finishes within SUITE_SECONDS (default 530 s): each step has a time limit, and the figures
# step gets what is left. The last thing printed is a summary and the figure table. Without a
# CUDA device it says so and exits 0. Exit status: 0 when every step exited 0.
# GPU_SUITE_STEPS="correctness figures" runs only the steps named (default: all three).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu_suite}"
mkdir -p "$OUT"
SUITE_SECONDS="${SUITE_SECONDS:-530}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
PY=python3

# GPU_SUITE_SKIP_DEVICE_CHECK=1 runs the plumbing on a CPU machine (every step then skips)
if [ "${GPU_SUITE_SKIP_DEVICE_CHECK:-0}" != 1 ] &&
        ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_suite: no CUDA device here; nothing to run (the tests skip, the scripts exit 0)"
    exit 0
fi

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -40
    $PY - <<'EOF'
import importlib, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, name)
for name in ("triton", "transformers", "pytest", "gguf", "numpy"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
EOF
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>/dev/null
} > "$OUT/env.txt" 2>&1
# (the gguf package is not on the device; the loader imports it only for .gguf files)

STEP_NAMES=()
STEP_RESULTS=()
OVERALL=0
left() { echo $(( SUITE_SECONDS - SECONDS )); }

summary_kernel_tests() { grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$OUT/kernel_tests.log"; }
summary_native_kernels() { grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$OUT/native_kernels.log"; }
summary_correctness() { grep '^correctness:' "$OUT/correctness.log" || tail -1 "$OUT/correctness.log"; }
summary_figures() {
    if [ -s "$OUT/figures.txt" ]; then echo "$(( $(wc -l < "$OUT/figures.txt") - 1 )) figures"
    else tail -1 "$OUT/figures.log"; fi
}

# run_step NAME LIMIT_SECONDS -- COMMAND...   (summary_NAME gives the one-line result)
run_step() {
    local name=$1 limit=$2
    shift 3
    case " ${GPU_SUITE_STEPS:-kernel_tests correctness figures} " in
        *" $name "*) ;;
        *) echo "== $name: not in GPU_SUITE_STEPS, skipped"; return 0 ;;
    esac
    local start=$SECONDS rc
    echo "== $name (limit ${limit}s): $*"
    timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && OVERALL=1
    local note
    note=$("summary_$name" 2>/dev/null | tail -1)
    [ "$rc" -eq 124 ] && note="TIMED OUT after ${limit}s; $note"
    STEP_NAMES+=("$name")
    STEP_RESULTS+=("$(printf 'rc %-3s %4ss  %s' "$rc" "$(( SECONDS - start ))" "$note")")
    echo "   rc $rc in $(( SECONDS - start ))s: $note"
}

# 66 GPU cases took 110-118 s on the H200 in session 24 (most of it Triton compiles)
run_step kernel_tests "${KERNEL_MAX:-180}" -- \
    $PY -m pytest tests/attention tests/layers tests/executor -q -m gpu -p no:cacheprovider \
        -o addopts="" -rfE

# (the directories that hold `kernel` cases; the lent machines lack the server's and the GGUF
#  loader's packages, whose test modules would stop collection elsewhere)
run_step native_kernels "$(( $(left) - 10 ))" -- \
    $PY -m pytest tests/attention tests/layers tests/mem tests/models -q -m kernel \
        -p no:cacheprovider -o addopts="" -rfE --continue-on-collection-errors

CORR_LIMIT=$(( $(left) - 250 ))
CORR_MAX="${CORR_MAX:-170}"
[ "$CORR_LIMIT" -gt "$CORR_MAX" ] && CORR_LIMIT=$CORR_MAX
[ "$CORR_LIMIT" -lt 60 ] && CORR_LIMIT=60
run_step correctness "$CORR_LIMIT" -- \
    $PY benchmarks/gpu_correctness.py --out "$OUT" --time-budget $(( CORR_LIMIT - 45 ))

FIG_LIMIT=$(( $(left) - 5 ))
[ "$FIG_LIMIT" -lt 60 ] && FIG_LIMIT=60
run_step figures "$FIG_LIMIT" -- \
    $PY benchmarks/gpu_figures.py --out "$OUT" --time-budget $(( FIG_LIMIT - 25 ))

{
    echo
    echo "================ gpu_suite summary ($(( SECONDS ))s, logs in $OUT) ================"
    grep -E '^(torch|triton|transformers|note)' "$OUT/env.txt" | tr '\n' ';'; echo
    for i in "${!STEP_NAMES[@]}"; do
        printf '%-13s %s\n' "${STEP_NAMES[$i]}" "${STEP_RESULTS[$i]}"
    done
    echo "---- kernel test failures ----"
    grep -E '^(FAILED|ERROR)' "$OUT/kernel_tests.log" "$OUT/native_kernels.log" 2>/dev/null \
        | head -15 || true
    echo "---- correctness (non-PASS lines) ----"
    grep -E '^(FAIL|TIE|SKIP) ' "$OUT/correctness.log" 2>/dev/null | cut -c1-230 | head -20 || true
    echo "---- figures: figure | measured | limit | ratio (of the limit) | note ----"
    if [ -s "$OUT/figures.txt" ]; then cat "$OUT/figures.txt"; else
        echo "(no figures.txt; tail of figures.log:)"; tail -20 "$OUT/figures.log" 2>/dev/null; fi
} | tee "$OUT/summary.txt"
exit $OVERALL
