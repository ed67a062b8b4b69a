#!/usr/bin/env bash
# Everything torchgpipe checks and measures on a GPU, in one go: the environment, the
# whole test suite with the cuda tests, the demo, the seed's experiments that one GPU
# allows, the per-cell overhead with CUDA layers, a timeline of one step, and a probe
# of NCCL between two processes. Logs and JSON go to $OUT (default:
# benchmarks/gpu/results). Run from the repository root, with torchgpipe installed or
# importable:
#
#     bash benchmarks/gpu/run.sh                      # everything (about 20 minutes)
#     SECTIONS="env tests" bash benchmarks/gpu/run.sh # some of it
#     LIMIT_memory=120 MEMORY_ARGS="largest --models unet" bash benchmarks/gpu/run.sh
#
# Each section runs under its own time limit (LIMIT_<section> seconds overrides it) and a
# failure does not stop the others; the script exits non-zero if any section failed, and
# says which in summary.txt. With BUNDLE=path.tgz, the results so far are packed into one
# file after every section, so that a run cut short still leaves them in one place.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-benchmarks/gpu/results}
SECTIONS=${SECTIONS:-"env tests demo speed memory overhead timeline nccl"}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Importable from the source tree when not installed (a machine without network).
if ! "$PYTHON" -c "import torchgpipe" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=()
section() {  # section NAME LIMIT_SECONDS FUNCTION: run it, log to $OUT/NAME.log
    local name=$1 limit=$2 fn=$3 override="LIMIT_$1"
    case " $SECTIONS " in *" $name "*) ;; *) return 0 ;; esac
    limit=${!override:-$limit}
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    local started=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" bash -c "$fn" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started))s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
    if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE" -C "$OUT" .; fi
}

environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PYTHON" - <<'PY'
import platform, torch, torchgpipe
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "torchgpipe", torchgpipe.__version__)
for k in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(k)
    print(f"cuda:{k}", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
PY
}

tests() {  # the cuda tests, by name; beside them the rest of the suite, on the CPU
    local parallel=() limits=() rc=0 others
    # Not pyproject.toml's options, which run in parallel where pytest-xdist is (the
    # cuda tests share the GPU: one at a time), and fail where it is not.
    local options=(-o "addopts=-ra --strict-markers")
    # pytest-benchmark, where installed, warns that xdist disables it: not an error here.
    if "$PYTHON" -c "import xdist" 2>/dev/null; then parallel=(-n "${TEST_WORKERS:-8}" -p no:benchmark); fi
    # A test that hangs fails alone, with the stacks of its threads, where pytest-timeout is.
    if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then limits=(--timeout 90); fi
    # The tests not marked cuda use the CPU alone (tests/conftest.py hides the GPU from
    # them), so they run at the same time as the cuda tests.
    "$PYTHON" -m pytest "${options[@]}" -m "not cuda" -q -rf -p no:cacheprovider "${parallel[@]}" \
        "${limits[@]}" >"$OUT/tests-cpu.log" 2>&1 &
    others=$!
    # A job in the background ignores the section's interrupt: stop it with the section.
    trap 'kill "$others" 2>/dev/null' EXIT
    "$PYTHON" -m pytest "${options[@]}" -m cuda -rs -v -p no:cacheprovider "${limits[@]}" \
        --junitxml="$OUT/cuda-tests.xml" || rc=1
    wait "$others" || rc=1
    echo "--- the tests not marked cuda (tests-cpu.log):"
    tail -n 40 "$OUT/tests-cpu.log"
    return $rc
}

speed() {  # the seed's ResNet-101 and U-Net (5, 64) rows: naive-1 against pipeline-1
    local common=(--size full --devices cuda --partitions 1 --chunks 2 --warmup 3) row
    for row in ${SPEED_ROWS:-resnet101 resnet101-large unet}; do
        case $row in
            resnet101) set -- --models resnet101 --naive-batch 118 --batch 220 --steps 20 ;;
            resnet101-large) set -- --models resnet101 --naive-batch 256 --batch 512 --steps 10 ;;
            unet) set -- --models unet --naive-batch 40 --batch 80 --steps 10 ;;
            *) echo "unknown speed row: $row (resnet101, resnet101-large, unet)"; return 2 ;;
        esac
        "$PYTHON" benchmarks/speed/main.py "${common[@]}" "$@" --out "$OUT/speed-$row.json" \
            || return 1
    done
}

memory() {  # the seed's AmoebaNet-D and U-Net memory rows, and the largest that fits
    # shellcheck disable=SC2086  # MEMORY_ARGS is a list of words
    "$PYTHON" benchmarks/memory/seed.py ${MEMORY_ARGS:-rows largest} \
        --search-seconds "${SEARCH_SECONDS:-100}" --out "$OUT/memory-seed.json"
}

overhead() {
    # shellcheck disable=SC2086  # OVERHEAD_ARGS is a list of words
    "$PYTHON" benchmarks/gpu/overhead.py ${OVERHEAD_ARGS:-} --out "$OUT/overhead.json"
}

timeline() {
    "$PYTHON" benchmarks/gpu/timeline.py --out-dir "$OUT" --batch 256 --checkpoint never
}

nccl() {  # one rank runs the example on NCCL; then two ranks on the one GPU
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
        examples/train_distributed.py --backend nccl --steps 10 || return 1
    "$PYTHON" benchmarks/gpu/nccl_probe.py
}

export -f environment tests speed memory overhead timeline nccl
export OUT PYTHON

section env 60 environment
section tests 480 tests
section demo 180 "$PYTHON -m torchgpipe.demo"
section speed 420 speed
section memory 900 memory
section overhead 300 overhead
section timeline 180 timeline
section nccl 180 nccl

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "every section passed: $SECTIONS" | tee "$OUT/summary.txt"
else
    printf 'failed: %s\n' "${failed[@]}" | tee "$OUT/summary.txt"
    exit 1
fi
