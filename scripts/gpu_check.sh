#!/usr/bin/env bash
# GPU acceptance run, for a GPU machine that may have no network: build Horovod with NCCL against the machine's own
# torch from a carried sdist, then run the GPU tests, the input pipeline's benchmark and the one-GPU benchmark, and
# write the last one's figures into docs/benchmarks.md.
#
#   scripts/gpu_check.sh --horovod-sdist FILE [--python PATH] [--out DIR] [--rounds N] [--batch-size N] [--no-gpu]
#                        [--skip-step-bench] [--skip-tests | --tests EXPR]
#
#   1. checks a GPU is visible (nvidia-smi and torch.cuda) and stops otherwise;
#   2. scripts/install.sh --python PATH --offline --gpu --horovod-sdist FILE: Horovod with NCCL against that torch,
#      never reinstalling it (--no-mpi where OpenMPI is missing; the Gloo controller then serves the CPU side);
#   3. checks `horovodrun --check-build` lists NCCL;
#   4. runs the tests marked gpu (python -m pytest -m gpu; --tests EXPR: those pytest -k EXPR selects; --skip-tests:
#      none, for a lease too short for both the tests and the pipeline's figures);
#   5. benchmarks the input pipeline (bench/run.py --sections pipeline): ImageNet-like JPEGs decoded in the loader
#      workers and on the GPU, and ResNet-50 bf16 channels-last compiled trained from the folder and its shards
#      against its --benchmark rate (first, each figure printed as it is measured); the table goes to
#      OUT/pipeline.md;
#   6. benchmarks the app against a bare PyTorch loop on one GPU (resnet50, AMP bf16 and fp16, channels-last;
#      bench/gpu_acceptance.py) and writes the table into docs/benchmarks.md (--skip-step-bench leaves it out).
# Every step's output goes to OUT/gpu_check.log (default runs/gpu_check); the last lines say which steps passed.
# The exit code is 0 only when every step passed. --no-gpu runs the parts that need no GPU (2 and 3), to try the
# script, the sdist and the machine's toolchain (or an image) before GPU time is spent; 1, 4, 5 and 6 say SKIP.
#
# Bring the sdist from a machine with network: pip download --no-deps --no-binary :all: horovod==0.28.1
# (or `python scripts/horovod/build_horovod.py --print-sdist`, which prints the cached copy's path).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=python3
SDIST=""
OUT=$ROOT/runs/gpu_check
ROUNDS=3
BATCH=128
NEED_GPU=1
STEP_BENCH=1
TESTS=1
SELECT=()

die() { printf 'gpu_check.sh: error: %s\n' "$*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --horovod-sdist) [ $# -ge 2 ] || die "--horovod-sdist needs a file"; SDIST=$2; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PY=$2; shift ;;
        --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT=$2; shift ;;
        --rounds) [ $# -ge 2 ] || die "--rounds needs a number"; ROUNDS=$2; shift ;;
        --batch-size) [ $# -ge 2 ] || die "--batch-size needs a number"; BATCH=$2; shift ;;
        --no-gpu) NEED_GPU=0 ;;
        --skip-step-bench) STEP_BENCH=0 ;;
        --skip-tests) TESTS=0 ;;
        --tests) [ $# -ge 2 ] || die "--tests needs a pytest -k expression"; SELECT=(-k "$2"); shift ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
    shift
done
[ -n "$SDIST" ] || die "--horovod-sdist FILE is required: the GPU machine may have no network (see --help)"
[ -f "$SDIST" ] || die "--horovod-sdist $SDIST: no such file"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive whole number, not '$ROUNDS'"
[[ "$BATCH" =~ ^[1-9][0-9]*$ ]] || die "--batch-size must be a positive whole number, not '$BATCH'"
found=$(command -v "$PY") || die "--python: no interpreter '$PY'"
PY=$found
mkdir -p "$OUT" || die "cannot create $OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
cd "$ROOT"

results=()
# Runs one step, its output to the terminal and the log; records PASS or FAIL with the step's name.
step() {
    local name=$1; shift
    printf '\n==> %s\n$ %s\n' "$name" "$*" | tee -a "$LOG"
    if "$@" 2>&1 | tee -a "$LOG"; then results+=("PASS  $name"); return 0; fi
    results+=("FAIL  $name"); return 1
}
finish() {
    printf '\n==> Summary (log: %s)\n' "$LOG" | tee -a "$LOG"
    printf '%s\n' "${results[@]}" | tee -a "$LOG"
    for r in "${results[@]}"; do [[ $r == FAIL* ]] && exit 1; done
    exit 0
}

gpu_visible() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo "no nvidia-smi: this is not a GPU machine (or the driver is missing)"; return 1; }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || return 1
    "$PY" -c 'import sys, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU (torch.cuda.is_available() is False)")'
}
if [ "$NEED_GPU" = 1 ]; then step "GPU visible" gpu_visible || finish; else results+=("SKIP  GPU visible (--no-gpu)"); fi

install_args=(--python "$PY" --offline --gpu --horovod-sdist "$SDIST")
if ! command -v mpicxx >/dev/null 2>&1; then
    echo "no mpicxx on this machine: building the Gloo controller alone (--no-mpi)" | tee -a "$LOG"
    install_args+=(--no-mpi)
fi
step "Horovod with NCCL against this machine's torch (offline)" bash scripts/install.sh "${install_args[@]}" || finish

BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
export PATH="$BIN:$PATH"
nccl_listed() { "$BIN/horovodrun" --check-build | tee /dev/stderr | grep -qE '\[X\] NCCL'; }
step "horovodrun --check-build lists NCCL" nccl_listed || finish

if [ "$NEED_GPU" = 0 ]; then
    results+=("SKIP  GPU tests (--no-gpu)" "SKIP  Input pipeline benchmark (--no-gpu)" "SKIP  One-GPU benchmark (--no-gpu)")
    finish
fi
# The GPU tests' own file: collecting the whole suite would import what only the CPU suite needs (mlflow's client,
# which a GPU image may lack), and one missing import would stop the run before any GPU test.
# Side by side where pytest-xdist is there: the tests are small next to one GPU's memory and the node's cores.
parallel=()
"$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 4)
if [ "$TESTS" = 1 ]; then
    step "GPU tests (pytest -m gpu)" "$PY" -m pytest -m gpu -v -p no:cacheprovider "${parallel[@]}" "${SELECT[@]}" \
        tests/launch/test_gpu.py
else
    results+=("SKIP  GPU tests (--skip-tests)")
fi
pipeline() {
    "$PY" bench/run.py --sections pipeline --repeats 1 --results-dir "$OUT/bench" || return 1
    cat "$OUT"/bench/*.md >"$OUT/pipeline.md"
}
step "Input pipeline benchmark (bench/run.py --sections pipeline)" pipeline
if [ "$STEP_BENCH" = 1 ]; then
    step "One-GPU benchmark: app against a bare loop" "$PY" bench/gpu_acceptance.py --rounds "$ROUNDS" \
        --batch-size "$BATCH" --write-doc docs/benchmarks.md
else
    results+=("SKIP  One-GPU benchmark (--skip-step-bench)")
fi
finish
