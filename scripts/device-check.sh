#!/usr/bin/env bash
# The GPU check of fedopt_kernels in one command:  scripts/device-check.sh OUT_DIR
#                                                  (make device-check; make gpu-check)
#
# Made for a bare, offline GPU machine lent for minutes, whose python3 already holds
# torch (and triton): no venv, no pip, no download.  It builds the extensions in place
# for the present GPU only, with every core, then runs the most informative steps
# first, each under its own timeout and all under one deadline, so that a hang costs
# one step and a lease that ends early still leaves the steps done so far:
#
#   env, build (C++ CPU + CUDA extensions, this GPU's sm only), info     CPU parts
#   selftest --device cuda           every op x backend against python_ref / fp64
#   pytest-gpu                       the cuda / triton cases of the test suite
#   sanitizer-memcheck               compute-sanitizer on the kernels' edge cases
#   gpu-harness                      tools/gpu_harness: every CUDA kernel family through its
#                                    torch-free launcher, and compiled Triton PTX, against
#                                    python_ref (tests/test_gpu_harness.py), each run under
#                                    compute-sanitizer memcheck; built with this GPU's SASS
#   bench                            kernels vs torch's anchors, fraction of HBM peak,
#                                    launches per step; the batched simulator on CUDA
#                                    against the CPU engine
#   bench-triton                     the same kernels on the Triton backend
#
# A step that needs CUDA is reported SKIP where torch sees no CUDA device, so on a CPU
# machine the script is a dry run of everything else (and exits 0 if that passes).
#
# OUT_DIR gets at most 8 files, written as the run goes (a killed run keeps them):
#   summary.txt      one line per step (status, seconds, log), the key results, and
#                    the tail of every failed step's log; rewritten after every step
#   logs.tar.gz      every step's full log (logs/<step>.txt), re-packed after every step
#   selftest.json, pytest-gpu.xml, bench.json, bench-triton.json, info.json
# The summary is also printed at the end.  Exit status: 0 when no step failed or was
# left out for lack of time (a step that cannot run here, SKIP(no CUDA), is not a
# failure), 1 otherwise, 2 for bad usage.
#
# Environment:
#   PYTHON                 the interpreter (default python3)
#   DEVICE_CHECK_PROFILE   lease (default): the steps above within DEVICE_CHECK_BUDGET;
#                          full (make gpu-check): also nvidia-smi -q, the docs' GPU
#                          snippets, racecheck and initcheck, full-length benchmarks,
#                          and no deadline
#   DEVICE_CHECK_BUDGET    seconds for the whole script (default 470 for lease)
#   DEVICE_CHECK_BUILD     1 (default): build the extensions in place; 0: use what is built
#   DEVICE_CHECK_BUILD_TIMEOUT  the build step's limit (default 300 s: 16 cores)
#   DEVICE_CHECK_CUDA_ARCH the sm to build the CUDA extension for (default: the present
#                          GPU's, e.g. 9.0; without a GPU the CUDA extension is not built
#                          unless this names one -- a compile-only check)
#   DEVICE_CHECK_SKIP      space-separated step names to leave out (reported SKIP)
#   DEVICE_CHECK_LIMITS    space-separated STEP=SECONDS overrides of steps' own limits
#   DEVICE_CHECK_JOBS      parallel compile jobs / pytest workers (default: every core)

set -u -o pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: scripts/device-check.sh OUT_DIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" || { echo "device-check: cannot create $1" >&2; exit 2; }
OUT="$(cd "$1" && pwd)"
cd "$ROOT" || exit 2

PROFILE="${DEVICE_CHECK_PROFILE:-lease}"
case "$PROFILE" in
    lease) BUDGET="${DEVICE_CHECK_BUDGET:-470}" ;;
    full) BUDGET="${DEVICE_CHECK_BUDGET:-86400}" ;;
    *) echo "device-check: DEVICE_CHECK_PROFILE must be lease or full, got '$PROFILE'" >&2; exit 2 ;;
esac
case "$BUDGET" in
    '' | *[!0-9]*) echo "device-check: DEVICE_CHECK_BUDGET must be a whole number of seconds, got '$BUDGET'" >&2
        exit 2 ;;
esac
LIMITS=" ${DEVICE_CHECK_LIMITS:-} "
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "device-check: PYTHON=$PY not found" >&2
    exit 2
fi
# nproc without the OpenMP variables: GNU nproc reports OMP_NUM_THREADS when it is set, and a
# shell that exports OMP_NUM_THREADS=1 would build on one core of a 16-core lease.  The
# CPU affinity (taskset, a container's cpuset) still counts.
JOBS="${DEVICE_CHECK_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 4)}"
SKIP=" ${DEVICE_CHECK_SKIP:-} "
# Compiled Triton kernels, not the interpreter (triton.jit reads it when a kernel is
# defined), and no backend forced on every op.
unset TRITON_INTERPRET FEDOPT_BACKEND
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

LOGS="$(mktemp -d)"
mkdir -p "$LOGS/logs"
trap 'rm -rf "$LOGS"' EXIT
START=$SECONDS
RESERVE=10  # seconds kept for the last summary and archive

NAMES=()
STATUS=()
TIMES=()
FAILED=0
SKIPPED=0
OUT_OF_TIME=0

# What torch sees (also decides which steps can run); a driver that hangs costs 120 s.
PROBE="$(timeout --kill-after=5 120 "$PY" - <<'EOF' 2>/dev/null
import platform, torch
try:
    import triton
    tv = triton.__version__
except Exception:
    tv = "none"
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
cap = "%d.%d" % torch.cuda.get_device_capability(0) if cuda else ""
print(int(cuda), cap, f"{name}; torch {torch.__version__}, triton {tv}, python {platform.python_version()}", sep="|")
EOF
)"
if [ -z "$PROBE" ]; then
    echo "device-check: $PY cannot import torch (or timed out asking it for the GPU)" >&2
    exit 2
fi
HAS_CUDA="${PROBE%%|*}"
REST="${PROBE#*|}"
GPU_CC="${REST%%|*}"
MACHINE="${REST#*|}"
ARCH="${DEVICE_CHECK_CUDA_ARCH:-$GPU_CC}"

write_summary() {  # the whole summary, from what is known now
    local final=${1:-0} i f
    {
        echo "device-check ($PROFILE) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): $MACHINE"
        printf '%-20s %-14s %7s  %s\n' step status seconds log
        for i in "${!NAMES[@]}"; do
            printf '%-20s %-14s %7s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "logs/${NAMES[$i]}.txt"
        done
        if [ "$final" = 1 ]; then
            printf '\ndevice-check: %d steps, %d failed, %d skipped, %d s (budget %d s); logs in logs.tar.gz\n' \
                "${#NAMES[@]}" "$FAILED" "$SKIPPED" $((SECONDS - START)) "$BUDGET"
            [ "$OUT_OF_TIME" = 0 ] || echo "device-check: $OUT_OF_TIME step(s) left out for lack of time (SKIP(budget))"
            [ "$HAS_CUDA" = 1 ] || echo "device-check: torch sees no CUDA device here, so this was a dry run of the CPU parts"
        else
            printf '\ndevice-check: running, %d s so far (budget %d s)\n' $((SECONDS - START)) "$BUDGET"
        fi
        if [ -s "$LOGS/results.txt" ]; then
            echo
            echo "== key results"
            cat "$LOGS/results.txt"
        fi
        for i in "${!NAMES[@]}"; do
            case "${STATUS[$i]}" in
                FAIL* | TIMEOUT*)
                    f="$LOGS/logs/${NAMES[$i]}.txt"
                    echo
                    echo "== ${NAMES[$i]} ${STATUS[$i]}: last lines of logs/${NAMES[$i]}.txt"
                    [ -f "$f" ] && tail -n 25 "$f" | cut -c1-300
                    ;;
            esac
        done
    } >"$OUT/summary.txt.tmp"
    mv "$OUT/summary.txt.tmp" "$OUT/summary.txt"
    tar -czf "$OUT/logs.tar.gz.tmp" -C "$LOGS" logs && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

result() {  # a line for the summary's key results
    echo "$*" >>"$LOGS/results.txt"
}

# step NAME NEEDS(cpu|gpu) TIMEOUT COMMAND...: run it (stdout and stderr into
# logs/NAME.txt) under min(TIMEOUT, what is left of the budget), record its status.
step() {
    local name=$1 needs=$2 limit=$3 left t0 rc status override
    shift 3
    override="${LIMITS##* $name=}"
    if [ "$override" != "$LIMITS" ]; then
        limit="${override%% *}"
    fi
    left=$((BUDGET - (SECONDS - START) - RESERVE))
    if [[ "$SKIP" == *" $name "* ]]; then
        status="SKIP(asked)"
    elif [ "$needs" = gpu ] && [ "$HAS_CUDA" != 1 ]; then
        status="SKIP(no CUDA)"
    elif [ "$left" -lt 15 ]; then
        status="SKIP(budget)"
        OUT_OF_TIME=$((OUT_OF_TIME + 1))
    fi
    if [ -n "${status:-}" ]; then
        echo "== $name: $status"
        NAMES+=("$name"); STATUS+=("$status"); TIMES+=(0)
        SKIPPED=$((SKIPPED + 1))
        write_summary
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit} s): $*"
    t0=$SECONDS
    {
        echo "\$ $*"
        echo "(limit ${limit} s, started $(date -u +%H:%M:%S))"
    } >"$LOGS/logs/$name.txt"
    timeout --kill-after=10 "$limit" "$@" >>"$LOGS/logs/$name.txt" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
        status=ok
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status="TIMEOUT(${limit}s)"
        FAILED=$((FAILED + 1))
    else
        status="FAIL($rc)"
        FAILED=$((FAILED + 1))
    fi
    echo "   $status after $((SECONDS - t0)) s"
    NAMES+=("$name"); STATUS+=("$status"); TIMES+=($((SECONDS - t0)))
    write_summary
    return 0
}

last_line() {  # last_line STEP PATTERN: the last line of a step's log matching PATTERN
    grep -E "$2" "$LOGS/logs/$1.txt" 2>/dev/null | tail -n 1
}

# ---------------------------------------------------------------- CPU parts
step env cpu 60 bash -c '
    echo "## python"; "$0" -c "import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)"
    "$0" -c "import triton; print(\"triton\", triton.__version__)" || true
    echo "## nproc: $(nproc), jobs: $1"; echo "## nvcc"; nvcc --version 2>&1 | tail -n 2 || true
    echo "## ninja: $(ninja --version 2>/dev/null || echo none)"
    echo "## nvidia-smi"; nvidia-smi 2>&1 || true' "$PY" "$JOBS"

if [ "${DEVICE_CHECK_BUILD:-1}" = 1 ]; then
    if [ -n "$ARCH" ]; then
        build_cuda=1
    else
        build_cuda=0
    fi
    step build cpu "${DEVICE_CHECK_BUILD_TIMEOUT:-300}" env MAX_JOBS="$JOBS" FEDOPT_BUILD_CUDA="$build_cuda" FEDOPT_CUDA_ARCH_LIST="$ARCH" \
        "$PY" setup.py build_ext --inplace
    result "build: CUDA extension $([ "$build_cuda" = 1 ] && echo "for sm ${ARCH}" || echo "not built (no GPU)"), $JOBS jobs"
fi
step info cpu 60 bash -c '"$0" -m fedopt_kernels info --json >"$1"' "$PY" "$OUT/info.json"

# ---------------------------------------------------------------- GPU steps
step selftest gpu 180 "$PY" -m fedopt_kernels selftest --device cuda --json "$OUT/selftest.json"
line="$(last_line selftest '^fedopt selftest on')"
[ -n "$line" ] && result "$line"

WORKERS=$((JOBS < 8 ? JOBS : 8))
# (tests/test_gpu_harness.py has its own step below, under compute-sanitizer.)
step pytest-gpu gpu 240 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" -k "cuda or triton" \
    -n "$WORKERS" --dist loadfile --junitxml="$OUT/pytest-gpu.xml" --ignore=tests/test_gpu_harness.py tests
line="$(last_line pytest-gpu '(passed|failed|error)')"
[ -n "$line" ] && result "pytest-gpu: $line"

if [ "$PROFILE" = full ]; then
    step nvidia-smi-q gpu 60 nvidia-smi -q
    step pytest-readme gpu 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_readme_snippets.py
fi

SANITIZER="$(command -v compute-sanitizer || true)"
for dir in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -z "$SANITIZER" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ]; then
        SANITIZER="$dir/bin/compute-sanitizer"
    fi
done
TOOLS="memcheck"
[ "$PROFILE" = full ] && TOOLS="memcheck racecheck initcheck"
for tool in $TOOLS; do
    # Without torch's caching allocator every tensor is its own allocation, so a read
    # past the end of one is outside any allocation and memcheck sees it.
    step "sanitizer-$tool" gpu 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        "${SANITIZER:-compute-sanitizer}" --tool "$tool" --error-exitcode 99 "$PY" scripts/sanitizer_driver.py \
        --device cuda
done

# The harness: SASS for this GPU (the code a GPU runs, not the PTX a simulator runs),
# every run of it under memcheck.  Its tests skip, saying why, where it cannot run.
HARNESS_ARCHS="sm_${ARCH//./} ${ARCH//./}"
[ -z "$ARCH" ] && HARNESS_ARCHS=90
step gpu-harness gpu 240 env FEDOPT_HARNESS_ARCHS="$HARNESS_ARCHS" \
    FEDOPT_HARNESS_WRAPPER="${SANITIZER:-compute-sanitizer} --tool memcheck --error-exitcode 99" \
    "$PY" -m pytest -q -p no:cacheprovider -rs -n "$WORKERS" tests/test_gpu_harness.py
line="$(last_line gpu-harness '(passed|failed|error)')"
[ -n "$line" ] && result "gpu-harness: $line"

QUICK="--quick"
[ "$PROFILE" = full ] && QUICK=""
step bench gpu 180 "$PY" -m fedopt_kernels bench --device cuda $QUICK --only nar_step --only aggregate \
    --only server --only device_vs_cpu --json "$OUT/bench.json"
step bench-triton gpu 120 "$PY" -m fedopt_kernels bench --device cuda --backend triton $QUICK --only nar_step \
    --only aggregate --only server --json "$OUT/bench-triton.json"
for b in bench bench-triton; do
    if [ -s "$OUT/$b.json" ]; then
        "$PY" -m fedopt_kernels.benchmarks.highlights "$OUT/$b.json" --label "$b" >>"$LOGS/results.txt" 2>&1 || true
    fi
done

write_summary 1
echo
cat "$OUT/summary.txt"
[ "$FAILED" -eq 0 ] && [ "$OUT_OF_TIME" -eq 0 ]
