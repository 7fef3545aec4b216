#!/usr/bin/env bash
# The GPU check a lent GPU machine runs: one build, then the phases named, in order, within one device call
# (GPU_CHECK_BUDGET seconds, build included; default 540, a device call ends at 600). Every
# step runs under `timeout`, capped by what is left, and is skipped when nothing is left:
#   smoke     machine facts, then a 2- and a 3-rank allreduce checked element by element (gpu_smoke.py)
#   loops     the 2-rank DDP (with and without set_device) and FSDP2 training loops against gloo
#   probes    tools/gpu_probes.py (a peer's wait must not stall a kernel; CUDA IPC on one GPU)
#   tests:N   slice N (1-4) of the tests with `cuda` in their id; tests:FILE one test file's
#   memcheck  compute-sanitizer memcheck on a small 2-rank allreduce
#   check     python -m torch_hca.check on CUDA tensors, 2 and 3 ranks on the GPU(s) (every op, dtype, algorithm)
#   bench     the benchmark on CUDA tensors (JSON + PNG); BENCH_ARGS replaces its default arguments
#   host      the host's time per call beside ProcessGroupNCCL's: world 1, hca's all-reduce and the nccl
#             pass-through beside stock NCCL, 8 B-64 MiB; then 2 ranks sharing the GPU, rank 1 50 ms late
#   shared    ranks sharing the GPU: the plan and waits a call makes (explain), the all-reduce sweep of 2, 3 and 4
#             ranks beside gloo, 8 B-64 MiB (JSON each), then torch_hca.check on 2 and 3 ranks
#   kernels   hca's copy and sum-of-k kernels beside torch's copy_ and add, 1 MiB-1 GiB, float32 and bf16, one
#             process (python -m torch_hca.bench --kernels); then the GPU tests of the kernels' vector paths
#   perf      where a step's time goes on one shared GPU: all-reduce on 1 rank (no other process to
#             switch to) and 2, with 1, 8 (the default) and 64 MiB staging chunks (steps against bytes);
#             PERF_WORLD_SIZES (default 1,2) names other world sizes, e.g. 3,4
#   bash tools/gpu_check.sh smoke loops probes tests:test_cuda.py
# Logs go to $OUT/logs.tar.gz (the device tool brings back 8 files at most), results (JSON, PNG)
# beside it; $OUT is the device tool's output folder, ./gpu-out elsewhere. Without a GPU every
# phase still runs (tests skip, the smoke runs on the CPU model): that is its check here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-gpu-out}")
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
(( $# )) || { echo "usage: gpu_check.sh PHASE... (smoke loops probes tests:N tests:FILE memcheck check bench host shared kernels perf)"; exit 2; }
LOGS=$OUT/logs
mkdir -p "$LOGS"
started=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-540}
# A hung launch in the tests gives up (its ranks' stacks printed) well before the device call ends;
# a failure is printed as it happens, since a run the call cuts never prints its summary.
export HCA_TEST_DEADLINE_S=${HCA_TEST_DEADLINE_S:-120} PYTHONUNBUFFERED=1 HCA_TEST_FAILURES_AT_ONCE=1

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
  "test_gather_scatter.py"
  "--ignore=test_collectives.py --ignore=test_in_flight.py --ignore=test_cuda.py --ignore=test_gather_scatter.py"
)

build() {
  {
    nvidia-smi
    nvcc --version
    $PYTHON -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version() if d.is_nccl_available() else None)"
  } > "$LOGS/env.txt" 2>&1
  local t0
  t0=$(date +%s)
  if ! bounded 300 env MAX_JOBS="$(nproc)" $PYTHON -m pip install --no-build-isolation -e . > "$LOGS/build.log" 2>&1; then
    tail -60 "$LOGS/build.log"
    echo "build failed"
    return 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
  $PYTHON -c "import torch, torch_hca; print('has_cuda', torch_hca._C.has_cuda); \
assert torch_hca._C.has_cuda or not torch.cuda.is_available(), 'built without CUDA on a GPU machine'"
  # That machine's compiler links its C++ runtime in statically: the copy must stay hidden.
  (cd tests && $PYTHON -m pytest -q -p no:cacheprovider test_launch.py -k static_cxx_runtime)
}

has_gpu() { $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }

# run_phase PHASE: one phase; its output goes to the terminal and to a log of its own.
run_phase() {
  case "$1" in
  smoke)
    local rc=0
    bounded 90 $PYTHON tools/gpu_smoke.py --world 2 || rc=1
    bounded 90 $PYTHON tools/gpu_smoke.py --world 3 --numel 3000001 || rc=1
    return $rc
    ;;
  loops)
    (cd tests && bounded 240 $PYTHON -m pytest -v -rs -k "$LOOPS" --junitxml "$LOGS/junit-loops.xml" test_in_flight.py)
    ;;
  probes)
    if has_gpu; then bounded 120 $PYTHON tools/gpu_probes.py --out "$OUT/probes.json"; else echo "no GPU: probes skipped"; fi
    ;;
  tests:*)
    local what=${1#tests:} selection
    if [[ $what =~ ^[0-9]+$ ]]; then selection=${SLICES[$what]}; else selection=$what; fi
    # -v streams one line per test, so a run cut by the timeout still tells what passed.
    (cd tests && bounded "$(( $(left) - 15 ))" $PYTHON -m pytest -v -rs -k cuda --durations=15 \
      --junitxml "$LOGS/junit-${what//\//_}.xml" $selection)
    ;;
  memcheck)
    # Every rank (spawned children) under the sanitizer, on a small allreduce; one round keeps it short.
    if command -v compute-sanitizer >/dev/null; then
      bounded "$(left)" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
        $PYTHON tools/gpu_smoke.py --world 2 --numel 65536 --rounds 1
      echo "compute-sanitizer memcheck: exit $?"
    else
      echo "compute-sanitizer not found: memcheck skipped"
    fi
    ;;
  check)
    bounded "$(left)" $PYTHON -m torch_hca.check --device "$(has_gpu && echo cuda || echo cpu)" --world-sizes 2,3 \
      --json "$OUT/check.json" \
      --log "$LOGS/check-lines.log"
    ;;
  bench)
    # shellcheck disable=SC2086
    bounded "$(left)" $PYTHON benchmarks/bench.py --device cuda --out "$OUT" \
      ${BENCH_ARGS:---world-sizes 1,2,3,4 --ops all_reduce,latency --latency-world-sizes 1,2,4}
    ;;
  host)
    local rc=0 device
    device=$(has_gpu && echo cuda || echo model)  # no GPU: the CPU model of the device (the script's own check)
    bounded "$(( $(left) / 3 ))" $PYTHON -m torch_hca.bench --device "$device" --nprocs 1 -b 8 -e 64M -f 8 \
      --compare nccl --json "$OUT/host-ranks1.json" || rc=1
    bounded "$(( $(left) / 2 ))" $PYTHON -m torch_hca.bench --device "$device" --nprocs 1 -b 8 -e 64M -f 8 \
      --algorithm nccl --json "$OUT/host-ranks1-passthrough.json" || rc=1
    bounded "$(left)" $PYTHON -m torch_hca.bench --device "$device" --nprocs 2 -b 8 -e 64M -f 64 \
      --late-rank 1:50 -n 20 --json "$OUT/host-ranks2-late.json" || rc=1
    return $rc
    ;;
  shared)
    local rc=0 device ranks
    device=$(has_gpu && echo cuda || echo model)
    for ranks in 2 3 4; do
      # the plan each sweep runs, and the waits on peers a call makes (each a switch between processes)
      for numel in 1 16777216; do
        $PYTHON -m torch_hca.explain "$ranks" --device cuda --gpus "$(printf '0,%.0s' $(seq 2 "$ranks"))0" \
          --numels "$numel" >> "$LOGS/shared-explain-ranks$ranks.log" 2>&1 || rc=1
      done
      bounded "$(( $(left) / (6 - ranks) ))" $PYTHON -m torch_hca.bench --device "$device" --nprocs "$ranks" -b 8 \
        -e 64M -f 8 --compare gloo --json "$OUT/shared-ranks$ranks.json" || rc=1
    done
    bounded "$(left)" $PYTHON -m torch_hca.check --device "$([[ $device == cuda ]] && echo cuda || echo cpu)" \
      --world-sizes 2,3 --json "$OUT/shared-check.json" --log "$LOGS/shared-check-lines.log" || rc=1
    return $rc
    ;;
  kernels)
    local rc=0 device
    device=$(has_gpu && echo cuda || echo cpu)  # no GPU: the host kernels, up to 16 MiB (the script's own check)
    bounded "$(( $(left) * 2 / 3 ))" $PYTHON -m torch_hca.bench --kernels --device "$device" -b 1M \
      -e "$([[ $device == cuda ]] && echo 1G || echo 16M)" -f 4 --json "$OUT/kernels.json" || rc=1
    (cd tests && bounded "$(left)" $PYTHON -m pytest -v -rs -k "kernel" test_cuda.py) || rc=1
    return $rc
    ;;
  perf)
    local chunk rc=0 runs=3
    for chunk in 1 8 64; do
      TORCH_HCA_CUDA_CHUNK_BYTES=$((chunk << 20)) bounded "$(( $(left) / runs ))" $PYTHON benchmarks/bench.py \
        --world-sizes "${PERF_WORLD_SIZES:-1,2}" --ops all_reduce --step 16 --out "$OUT/perf/chunk${chunk}MiB" || rc=1
      runs=$((runs - 1))
    done
    rm -f "$OUT"/perf/*/*.png  # the JSON holds the numbers; the device tool brings back 8 files at most
    return $rc
    ;;
  *)
    echo "unknown phase $1 (smoke loops probes tests:N tests:FILE memcheck check bench host shared kernels perf)"
    return 2
    ;;
  esac
}

# The logs, packed whatever happens (a phase cut short, a failed build).
trap 'tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"' EXIT
# GPU_CHECK_BUILT=1: the checkout is built already (a check of this script on a developer's machine)
if [[ ${GPU_CHECK_BUILT:-0} != 1 ]]; then
  build 2>&1 | tee "$LOGS/build-summary.log"
  (( PIPESTATUS[0] == 0 )) || exit 1
fi
status=0
for phase in "$@"; do
  t0=$(date +%s)
  echo "=== $phase ($(left) s left)"
  run_phase "$phase" 2>&1 | tee "$LOGS/${phase//[:\/]/_}.log"
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  echo "=== $phase: exit $rc, $(( $(date +%s) - t0 )) s"
done
echo "gpu_check: $(( $(date +%s) - started )) s"
exit $status
