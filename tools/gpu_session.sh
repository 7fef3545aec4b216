#!/usr/bin/env bash
# A lent GPU session, one device call per phase. Every call gets a bare machine, so every phase
# builds first (its own, within the call), then does its part, all within 9 minutes:
#   bash tools/gpu_session.sh smoke       # machine facts, build, a 2-rank allreduce, the probes (gpu_probes.py)
#   bash tools/gpu_session.sh tests N     # build, then slice N (1-3) of the tests that run CUDA tensors
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
  if ! MAX_JOBS=$(nproc) timeout 300 $PYTHON -m pip install --no-build-isolation -e . > "$OUT/build.log" 2>&1; then
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
  timeout 120 $PYTHON tools/gpu_smoke.py --world 2 2>&1 | tee "$OUT/smoke.log"
  if $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    timeout "$(left)" $PYTHON tools/gpu_probes.py --out "$OUT/probes.json" 2>&1 | tee "$OUT/probes.log"
  else
    echo "no GPU: probes skipped" | tee "$OUT/probes.log"
  fi
  ;;
tests)
  n=${2:?tests needs a slice number, 1-${#SLICES[@]}}
  # -v streams one line per test, so a run cut by the timeout still tells what passed.
  (cd tests && timeout "$(( $(left) - 10 ))" $PYTHON -m pytest -v -rs -k cuda --durations=15 \
    --junitxml "$OUT/junit-$n.xml" ${SLICES[$n]} 2>&1 | tee "$OUT/tests-$n.log")
  ;;
memcheck)
  # Every rank (spawned children) under the sanitizer, on a small allreduce; one round keeps it short.
  if command -v compute-sanitizer >/dev/null; then
    timeout "$(left)" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
      $PYTHON tools/gpu_smoke.py --world 2 --numel 65536 --rounds 1 > "$OUT/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: exit $?" | tee -a "$OUT/memcheck.log"
    tail -5 "$OUT/memcheck.log"
  else
    echo "compute-sanitizer not found: memcheck skipped" | tee "$OUT/memcheck.log"
  fi
  ;;
bench)
  timeout "$(left)" $PYTHON benchmarks/bench.py --device cuda --world-sizes 1,2,3,4 --ops allreduce,latency \
    --latency-world-sizes 1,2,4 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  ;;
*)
  echo "unknown phase $phase (smoke, tests N, memcheck or bench)"
  exit 2
  ;;
esac
echo "phase $phase: $(( $(date +%s) - started )) s"
