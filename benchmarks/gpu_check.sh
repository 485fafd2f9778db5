#!/usr/bin/env bash
# ONE prepared GPU check for a GPU host or a lent device: < 12 minutes, every figure printed and kept.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine, from anywhere (it cd's to the repo root)
#   bash benchmarks/gpu_check.sh --smoke    # tiny sizes: the code paths only (on CPU every step is then a SKIP)
#
# Steps, each under its own `timeout` (seconds; override with the variables):
#   setup  T_SETUP=60   pick a Python (PYTHON, else .venv/bin/python, python3, python: the first whose torch
#                       sees CUDA, else the first with torch); when a module the project needs is missing, try
#                       to add it in a throwaway venv on top of that Python (GPU_CHECK_VENV, default
#                       /tmp/gpu_check_venv, --system-site-packages) with the pins of requirements/gpu.txt /
#                       requirements/cpu.txt under a constraints file of what is installed, so torch, vllm,
#                       transformers, triton never change (docker/install-gpu-profile.sh's rule);
#                       GPU_CHECK_INSTALL=0 skips that. No network is needed: pip gives up within seconds.
#   tests  T_TESTS=120  pytest -m gpu tests/integration/test_model_gpu.py tests/integration/test_train_gpu.py
#   flex   T_FLEX=180   benchmarks/train.py: dense-mask vs flex BlockMask (compiled kernel) vs flex with the
#                       drafter under torch.compile, training step at seq 4096 / 512 anchors, the Qwen3.6-27B
#                       drafter (params/gpu-qwen3.6-27b.yaml): ms/step, tokens/s, peak GiB; goal flex >= 3x
#   mfu    T_MFU=45     benchmarks/drafter_mfu.py: bf16 step time and MFU of the 1.73 B drafter (the planner's
#                       FLOPs model; peak = params/hardware.yaml profile and a measured bf16 matmul)
#   fla    T_FLA=60     benchmarks/fla_forward.py: a 4-layer Qwen3.5 decoder (27B layer geometry) through
#                       fla-core's chunk_gated_delta_rule at 4096 tokens, checked against the torch path
#   serve  T_SERVE=150  benchmarks/successors_serve.py: a tiny DSpark and a tiny DFlash2 drafter (over-fitted
#                       on a tiny random Qwen3 target's greedy continuations) served by vLLM's V2 model runner,
#                       tau and per-position counts against the reference evaluator's; goal |gap| <= 5%
#   pilot  T_PILOT=120  benchmarks/pilot_27b.py: the training pilot (python -m stages.train --pilot's code) with the
#                       27B drafter and a random 6-layer target of the real width and vocabulary: step time of the
#                       worst and ordinary rows, peak memory, MFU, attention path and GDN kernels
# The budgets add up to ~11 min; GPU_CHECK_SKIP="serve pilot" (names, space-separated) skips steps to fit a
# shorter window, each printed as a SKIP line.
# Output: OUT (the device tool sets it; default ./gpu_check_out): env.json, NAME.log and NAME.json per step,
# tests.xml, gpu_check.json (all figures), summary.txt (the table printed last). Exit status 0 whatever a step
# does: a failing step's line says FAIL and why; a step that cannot run here says SKIP and why.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
SMOKE=0
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (use --smoke or --help)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
rm -f "$OUT"/steps.tsv "$OUT"/*.json "$OUT"/tests.xml
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DVC_NO_ANALYTICS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OVERLAY=params/gpu-qwen3.6-27b.yaml
START=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*"; }

# record NAME RC SECONDS BUDGET [NOTE]
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >> "$OUT/steps.tsv"; }

# step NAME BUDGET CMD...: run under timeout, log to OUT/NAME.log, show its last lines
step() {
    local name=$1 budget=$2 t0 rc
    shift 2
    say "$name: $* (budget ${budget}s)"
    t0=$(date +%s)
    timeout -k 10 "$budget" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    record "$name" "$rc" "$(( $(date +%s) - t0 ))" "$budget"
    grep -v -e '^\s*$' -e 'Warning' -e '_warn_once' "$OUT/$name.log" | tail -n 12 | sed "s/^/  $name| /"
    say "$name: exit $rc"
}

skip() { say "$1: SKIP $2"; record "$1" 0 0 0 "SKIP: $2"; }

# ---- setup: a Python with torch (CUDA preferred), the modules each step needs --------------------------
PY=""
cuda_of() { timeout 60 "$1" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null | tail -n 1; }
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [[ -n "$cand" ]] && command -v "$cand" > /dev/null 2>&1 || continue
    c=$(cuda_of "$cand")
    if [[ "$c" == 1 ]]; then PY=$cand; break; fi
    if [[ "$c" == 0 && -z "$PY" ]]; then PY=$cand; fi
done
if [[ -z "$PY" ]]; then
    PY=$(command -v python3 || command -v python || true)
fi
if [[ -z "$PY" ]]; then
    echo "gpu_check: no Python on PATH: nothing can run" | tee "$OUT/summary.txt"
    exit 0
fi
missing() { "$PY" benchmarks/gpu_check_report.py missing "$@"; }
NEED_PROJECT=(torch numpy ruamel.yaml pyarrow)
want=$(missing "${NEED_PROJECT[@]}" transformers pytest fla)
if [[ -n "$want" && "${GPU_CHECK_INSTALL:-1}" != 0 ]]; then
    say "setup: missing $want; trying a venv over $PY (pip, offline-safe)"
    VENV=${GPU_CHECK_VENV:-/tmp/gpu_check_venv}
    pins=()
    for m in $want; do
        dist=${m/fla/fla-core}
        [[ "$m" == torch || "$m" == transformers ]] && continue  # never from here: the machine's own or none
        pin=$(grep -ihE "^${dist//./[.]}==" requirements/gpu.txt requirements/cpu.txt | head -n 1 | cut -d' ' -f1)
        pins+=("${pin:-$dist}")
    done
    if [[ ${#pins[@]} -gt 0 ]]; then
        (
            set -e
            "$PY" -m venv --system-site-packages "$VENV"
            "$PY" -m pip list --format=freeze 2> /dev/null | grep -v -e '^-e' -e ' @ ' > "$VENV/constraints.txt" || true
            timeout "${T_SETUP:-60}" "$VENV/bin/python" -m pip install -q --retries 0 --timeout 5 \
                -c "$VENV/constraints.txt" "${pins[@]}"
        ) > "$OUT/setup.log" 2>&1 && PY=$VENV/bin/python && say "setup: installed ${pins[*]} into $VENV" \
            || say "setup: could not install ${pins[*]} (see $OUT/setup.log); the steps that need them SKIP"
    fi
fi
"$PY" benchmarks/gpu_check_report.py env "$OUT" 2>&1 | sed 's/^/  setup| /'
CUDA=$(cuda_of "$PY")
DEV=cpu
[[ "$CUDA" == 1 ]] && DEV=cuda
SMOKE_ARGS=()
[[ $SMOKE == 1 ]] && SMOKE_ARGS=(--smoke)
say "python $PY, device $DEV, smoke $SMOKE, out $OUT"

# runnable NAME MODULES...: true when this step can run here; otherwise records the SKIP
runnable() {
    local name=$1 absent
    shift
    if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
        skip "$name" "named in GPU_CHECK_SKIP"
        return 1
    fi
    if [[ "$DEV" != cuda && $SMOKE == 0 ]]; then
        skip "$name" "no CUDA device (bash benchmarks/gpu_check.sh --smoke checks the code paths on CPU)"
        return 1
    fi
    if ! absent=$(missing "$@"); then
        skip "$name" "python module(s) not importable: $absent"
        return 1
    fi
}

# ---- the steps -----------------------------------------------------------------------------------
if runnable tests "${NEED_PROJECT[@]}" transformers pytest; then
    step tests "${T_TESTS:-120}" "$PY" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT/tests.xml" \
        tests/integration/test_model_gpu.py tests/integration/test_train_gpu.py
fi
if runnable flex "${NEED_PROJECT[@]}"; then
    step flex "${T_FLEX:-180}" "$PY" benchmarks/train.py --device "$DEV" --overlay "$OVERLAY" --skip-packing \
        --backends sdpa flex flex-compiled --repeats 5 --json "$OUT/flex.json" "${SMOKE_ARGS[@]}"
fi
if runnable mfu "${NEED_PROJECT[@]}"; then
    step mfu "${T_MFU:-45}" "$PY" benchmarks/drafter_mfu.py --device "$DEV" --overlay "$OVERLAY" \
        --from "$OUT/flex.json" --json "$OUT/mfu.json" "${SMOKE_ARGS[@]}"
fi
if runnable fla torch transformers; then
    step fla "${T_FLA:-60}" "$PY" benchmarks/fla_forward.py --device "$DEV" --tokens 4096 --json "$OUT/fla.json" \
        "${SMOKE_ARGS[@]}"
fi
if runnable serve "${NEED_PROJECT[@]}" transformers safetensors; then
    step serve "${T_SERVE:-150}" "$PY" benchmarks/successors_serve.py --device "$DEV" --json "$OUT/serve.json" \
        "${SMOKE_ARGS[@]}"
fi
if runnable pilot "${NEED_PROJECT[@]}" transformers; then
    step pilot "${T_PILOT:-120}" "$PY" benchmarks/pilot_27b.py --device "$DEV" --json "$OUT/pilot.json" \
        "${SMOKE_ARGS[@]}"
fi

# ---- summary: always printed, exit 0 ------------------------------------------------------------------
echo
if ! "$PY" benchmarks/gpu_check_report.py summary "$OUT"; then
    echo "gpu_check: the summary script failed; raw step records (name, exit, seconds, budget, note):"
    cat "$OUT/steps.tsv" 2> /dev/null
fi
exit 0
