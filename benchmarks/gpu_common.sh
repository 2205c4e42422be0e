# Sourced by the benchmarks/*.sh device scripts, from the repository root:
#   . benchmarks/gpu_common.sh NAME "STEPS"
# sets OUT (default out/NAME, created), the environment every run needs (the repository on
# PYTHONPATH, unbuffered output, no hub access, quiet progress bars), STEPS, and:
#   step NAME            true when NAME is among STEPS
#   quiet                stdin without warning lines
#   start_server PORT LOG serve-flags...   a server in the background ($SERVER_PID), once its
#                        /health answers (up to 5 minutes; a server that exits returns at once).
#                        The lent machines lack the server's packages: carry the .whl that
#                        benchmarks/device_wheels.sh makes and install it first (its header says
#                        how), or every server step fails at import.
#   stop_server          stop it and wait
#   telemetry_start LOG  sample the GPU's SM clock, power and clock-limit reasons once a second
#                        into LOG (nvidia-smi CSV) in the background; telemetry_stop LOG stops
#                        it and prints benchmarks/gpu_telemetry.py's summary (an H200 held at
#                        its 700 W cap runs compute-bound kernels ~20% below burst speed)
OUT="${OUT:-$PWD/out/$1}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
STEPS="$2"
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
quiet() { grep -v -E 'Warning|return func|warnings.warn'; }
start_server() {
    local port=$1 log=$2
    shift 2
    python3 -m radixserve.cli serve --port "$port" "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 150); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && return 0
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "   server exited: $(tail -1 "$log")"
            return 1
        fi
        sleep 2
    done
}
stop_server() {
    kill "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
}
telemetry_start() {
    command -v nvidia-smi > /dev/null || return 0
    (while true; do
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
            --format=csv,noheader
        sleep 1
    done) > "$1" 2>&1 &
    TELEMETRY_PID=$!
}
telemetry_stop() {
    [ -n "${TELEMETRY_PID:-}" ] || return 0
    kill "$TELEMETRY_PID" 2>/dev/null
    wait "$TELEMETRY_PID" 2>/dev/null
    TELEMETRY_PID=
    python3 benchmarks/gpu_telemetry.py "$1"
}
