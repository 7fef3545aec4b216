#!/usr/bin/env bash
# A lent GPU session (issue 10) in three phases, each one device call of at most 10 minutes:
#   bash tools/gpu_session.sh build   # machine facts, build against its torch, the probes (gpu_probes.py)
#   bash tools/gpu_session.sh test [files]  # every test that runs CUDA tensors (pytest -k cuda)
#   bash tools/gpu_session.sh check   # compute-sanitizer memcheck and racecheck on a 3-rank test
#   bash tools/gpu_session.sh bench   # the benchmark on CUDA tensors (JSON + PNG)
# Logs and results go under $OUT (the device tool's output folder; ./gpu-out elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-gpu-out}")
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
phase=${1:?usage: gpu_session.sh build|test|check|bench}

case "$phase" in
build)
  {
    nvidia-smi
    nvcc --version
    $PYTHON -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version() if d.is_nccl_available() else None)"
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  start=$(date +%s)
  if ! $PYTHON -m pip install --no-build-isolation -e . > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s"
  $PYTHON -c "import torch_hca; assert torch_hca._C.has_cuda, 'built without CUDA'; print('has_cuda', True)" || exit 1
  timeout 300 $PYTHON tools/gpu_probes.py --out "$OUT/probes.json" 2>&1 | tee "$OUT/probes.log"
  ;;
test)
  # -v streams one line per test, so a run cut by the timeout still tells what passed.
  # Extra arguments select files (e.g. `test test_collectives.py`) when one call cannot hold them all.
  cd tests
  timeout 560 $PYTHON -m pytest -v -rs -k cuda --durations=15 --junitxml "$OUT/junit.xml" "${@:2}" 2>&1 |
    tee "$OUT/tests.log"
  ;;
check)
  # Every process of the run (ranks are spawned children) under the sanitizer.
  for tool in memcheck racecheck; do
    (cd tests && timeout 200 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
      $PYTHON -m pytest -q -x test_collectives.py -k "test_a_ring_of_three_slots and cuda" \
      > "$OUT/sanitizer-$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $?") | tee -a "$OUT/sanitizer.txt"
    tail -5 "$OUT/sanitizer-$tool.log"
  done
  ;;
bench)
  timeout 560 $PYTHON benchmarks/bench.py --device cuda --world-sizes 1,2,3,4 --ops allreduce,latency \
    --latency-world-sizes 1,2,4 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  ;;
*)
  echo "unknown phase $phase (build, test, check or bench)"
  exit 2
  ;;
esac
