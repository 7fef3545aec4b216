#!/usr/bin/env bash
# A lent GPU session, one device call per phase. Every call gets a bare machine, so every phase
# builds first (its own, within the call), then does its part, all within 9 minutes; every step
# runs under `timeout`, capped by what is left of the phase, and is skipped when nothing is left:
#   bash tools/gpu_session.sh smoke       # machine facts, build, first the 2-rank DDP and FSDP2 training
#                                         # loops against gloo (with and without set_device), then a
#                                         # 2-rank allreduce and the probes (gpu_probes.py)
#   bash tools/gpu_session.sh tests N     # on request: build, then slice N (1-3) of the CUDA tests
#   bash tools/gpu_session.sh memcheck    # build, then compute-sanitizer memcheck on a small 2-rank allreduce
#   bash tools/gpu_session.sh bench       # build, then the benchmark on CUDA tensors (JSON + PNG)
# Logs and results go under $OUT (the device tool's output folder; ./gpu-out elsewhere). Without a
# GPU every phase still runs (tests skip, the smoke runs on the CPU model): that is its check here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-gpu-out}")
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
phase=${1:?usage: gpu_session.sh smoke|tests N|memcheck|bench}
started=$(date +%s)
BUDGET=540  # seconds a phase may take, build included (a device call ends at 600)

left() { echo $(( BUDGET - ($(date +%s) - started) )); }

# bounded SECONDS COMMAND...: COMMAND under timeout, at most SECONDS and at most what the phase has left.
bounded() {
  local limit=$1
  shift
  local rest
  rest=$(left)
  (( rest < limit )) && limit=$rest
  if (( limit < 5 )); then
    echo "skipped (no time left in the phase): $*"
    return 124
  fi
  timeout "$limit" "$@"
}

# The training loops the CUDA path has never run, first: DDP (set_device and not) and FSDP2, 2 ranks.
LOOPS="cuda and (ddp_with_buckets_in_flight and 2 or ddp_on_cuda_without_set_device or fsdp2_overlapped and 2)"

# The CUDA tests in slices that each fit one call after the build (-k cuda selects them).
SLICES=(
  ""
  "test_collectives.py"
  "test_in_flight.py test_cuda.py"
  "--ignore=test_collectives.py --ignore=test_in_flight.py --ignore=test_cuda.py"
)

build() {
  {
    nvidia-smi
    nvcc --version
    $PYTHON -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version() if d.is_nccl_available() else None)"
  } > "$OUT/env.txt" 2>&1
  local t0
  t0=$(date +%s)
  if ! bounded 300 env MAX_JOBS="$(nproc)" $PYTHON -m pip install --no-build-isolation -e . > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    echo "build failed"
    exit 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
  $PYTHON -c "import torch, torch_hca; print('has_cuda', torch_hca._C.has_cuda); \
assert torch_hca._C.has_cuda or not torch.cuda.is_available(), 'built without CUDA on a GPU machine'" || exit 1
}

build
case "$phase" in
smoke)
  (cd tests && bounded 240 $PYTHON -m pytest -v -rs -k "$LOOPS" --junitxml "$OUT/junit-loops.xml" \
    test_in_flight.py 2>&1 | tee "$OUT/loops.log")
  bounded 120 $PYTHON tools/gpu_smoke.py --world 2 2>&1 | tee "$OUT/smoke.log"
  if $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    bounded "$(left)" $PYTHON tools/gpu_probes.py --out "$OUT/probes.json" 2>&1 | tee "$OUT/probes.log"
  else
    echo "no GPU: probes skipped" | tee "$OUT/probes.log"
  fi
  ;;
tests)
  n=${2:?tests needs a slice number, 1-${#SLICES[@]}}
  # -v streams one line per test, so a run cut by the timeout still tells what passed.
  (cd tests && bounded "$(( $(left) - 10 ))" $PYTHON -m pytest -v -rs -k cuda --durations=15 \
    --junitxml "$OUT/junit-$n.xml" ${SLICES[$n]} 2>&1 | tee "$OUT/tests-$n.log")
  ;;
memcheck)
  # Every rank (spawned children) under the sanitizer, on a small allreduce; one round keeps it short.
  if command -v compute-sanitizer >/dev/null; then
    bounded "$(left)" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
      $PYTHON tools/gpu_smoke.py --world 2 --numel 65536 --rounds 1 > "$OUT/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: exit $?" | tee -a "$OUT/memcheck.log"
    tail -5 "$OUT/memcheck.log"
  else
    echo "compute-sanitizer not found: memcheck skipped" | tee "$OUT/memcheck.log"
  fi
  ;;
bench)
  bounded "$(left)" $PYTHON benchmarks/bench.py --device cuda --world-sizes 1,2,3,4 --ops allreduce,latency \
    --latency-world-sizes 1,2,4 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  ;;
*)
  echo "unknown phase $phase (smoke, tests N, memcheck or bench)"
  exit 2
  ;;
esac
echo "phase $phase: $(( $(date +%s) - started )) s"
