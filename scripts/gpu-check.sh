#!/usr/bin/env bash
# The whole GPU check of fedopt_kernels in one command, for a
# machine with an NVIDIA GPU:  scripts/gpu-check.sh [OUT_DIR]   (or: make gpu-check)
#
# Every step runs, whatever the previous ones did, and writes into OUT_DIR (default
# gpu-check-<date>/): nvidia-smi, `fedopt info --json`, the GPU test subset (junit xml),
# `fedopt selftest --json`, compute-sanitizer memcheck / racecheck / initcheck on
# scripts/sanitizer_driver.py, and `fedopt bench --device cuda --json`.  At the end a
# summary table (also OUT_DIR/summary.txt); the exit status is 1 if any step failed.
#
# Environment: PYTHON (default .venv/bin/python, else python3); GPU_CHECK_SKIP, a
# space-separated list of step names to leave out (reported as skipped, e.g. "bench
# bench-triton" for a quick run).

set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" || { echo "gpu-check: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2

# Compiled Triton kernels on the GPU, not the interpreter (triton.jit reads this when a
# kernel is defined); and no backend forced on every op.
unset TRITON_INTERPRET FEDOPT_BACKEND

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
FEDOPT=("$PY" -m fedopt_kernels)
SKIP=" ${GPU_CHECK_SKIP:-} "

NAMES=()
CODES=()
TIMES=()
LOGS=()

record() {  # record NAME EXIT_CODE SECONDS LOG
    NAMES+=("$1"); CODES+=("$2"); TIMES+=("$3"); LOGS+=("$4")
}

# run_step NAME FILE SPLIT COMMAND...: run it, stdout into OUT/FILE and stderr too
# (SPLIT=0) or into OUT/FILE.stderr.txt, kept only when not empty (SPLIT=1); skipped
# when NAME is in GPU_CHECK_SKIP.
run_step() {
    local name=$1 file=$2 split=$3 t0=$SECONDS rc
    shift 3
    if [[ "$SKIP" == *" $name "* ]]; then
        echo "== $name: skipped (GPU_CHECK_SKIP)"
        record "$name" skip 0 "-"
        return
    fi
    echo "== $name: $*"
    if [ "$split" = 1 ]; then
        "$@" >"$OUT/$file" 2>"$OUT/$file.stderr.txt"
        rc=$?
        [ -s "$OUT/$file.stderr.txt" ] || rm -f "$OUT/$file.stderr.txt"
    else
        "$@" >"$OUT/$file" 2>&1
        rc=$?
    fi
    echo "   exit $rc after $((SECONDS - t0)) s -> $file"
    record "$name" "$rc" $((SECONDS - t0)) "$file"
}

# step NAME LOG COMMAND...: stdout and stderr into OUT/LOG.
step() { local name=$1 log=$2; shift 2; run_step "$name" "$log" 0 "$@"; }

# step_stdout NAME FILE COMMAND...: stdout alone into OUT/FILE (a JSON document),
# stderr into OUT/FILE.stderr.txt.
step_stdout() { local name=$1 file=$2; shift 2; run_step "$name" "$file" 1 "$@"; }

step nvidia-smi nvidia-smi.txt nvidia-smi
step nvidia-smi-q nvidia-smi-q.txt nvidia-smi -q
step_stdout info info.json "${FEDOPT[@]}" info --json

# The tests that exercise a GPU: every cuda / triton backend case of the matrix, the
# CUDA extension and CUDA-graph tests, the Triton kernels compiled for this GPU (the
# slow tier is real Flower / torchrun processes: no GPU code of ours).
step pytest-gpu pytest-gpu.txt "$PY" -m pytest -q -m "not slow" -k "cuda or triton" \
    --junitxml="$OUT/pytest-gpu.xml" tests
# The README's snippets marked "needs cuda" run where CUDA is available.
step pytest-readme pytest-readme.txt "$PY" -m pytest -q tests/test_readme_snippets.py \
    --junitxml="$OUT/pytest-readme.xml"

step selftest selftest.txt "${FEDOPT[@]}" selftest --device cuda --json "$OUT/selftest.json"

# compute-sanitizer on the edge cases.  Without torch's caching allocator every tensor
# is its own allocation, so a read past the end of one is outside any allocation and
# memcheck sees it (inside a cached block it would not).  initcheck may also name
# torch's own kernels (the log shows which kernel): ours are the fedopt_* / *_kernel ones.
SANITIZER="$(command -v compute-sanitizer || true)"
for dir in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -z "$SANITIZER" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ]; then
        SANITIZER="$dir/bin/compute-sanitizer"
    fi
done
for tool in memcheck racecheck initcheck; do
    if [ -z "$SANITIZER" ]; then
        echo "gpu-check: compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*)" >"$OUT/sanitizer-$tool.log"
        echo "== sanitizer-$tool: compute-sanitizer not found"
        record "sanitizer-$tool" 127 0 "sanitizer-$tool.log"
        continue
    fi
    step "sanitizer-$tool" "sanitizer-$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        "$SANITIZER" --tool "$tool" --error-exitcode 99 "$PY" scripts/sanitizer_driver.py --device cuda
done

# fedopt bench has --device and --json (fedopt_kernels/benchmarks/suite.py): the
# default backend on CUDA tensors (the C++ CUDA extension), then the Triton kernels.
step bench bench.txt "${FEDOPT[@]}" bench --device cuda --json "$OUT/bench.json"
step bench-triton bench-triton.txt "${FEDOPT[@]}" bench --device cuda --backend triton \
    --only nar_step --only aggregate --only server --json "$OUT/bench-triton.json"

failed=0
summary="$OUT/summary.txt"
printf '%-20s %-10s %7s  %s\n' step status seconds output >"$summary"
for i in "${!NAMES[@]}"; do
    code=${CODES[$i]}
    if [ "$code" = skip ]; then
        status=SKIP
    elif [ "$code" -eq 0 ]; then
        status=ok
    else
        status="FAIL($code)"
        failed=$((failed + 1))
    fi
    printf '%-20s %-10s %7s  %s\n' "${NAMES[$i]}" "$status" "${TIMES[$i]}" "${LOGS[$i]}" >>"$summary"
done
printf '\ngpu-check: %d steps, %d failed; everything is in %s\n' "${#NAMES[@]}" "$failed" "$OUT" >>"$summary"
echo
cat "$summary"
[ "$failed" -eq 0 ]
