#!/usr/bin/env bash
# One debugging device call: build, a native stack of the capture crash, the point-to-point fix, check's crash.
cd "$(dirname "$0")/.."
L=$OUT/logs; mkdir -p $L

t0=$(date +%s)
MAX_JOBS=16 python3 -m pip install --no-build-isolation -e . > $L/build.log 2>&1 || { tail -40 $L/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
export PYTHONUNBUFFERED=1 HCA_TEST_DEADLINE_S=40
timeout 35 cuda-gdb -batch -ex run -ex "thread apply all bt 25" --args python3 .dbg/capture_repro.py > $L/capture_gdb.log 2>&1; echo "capture gdb rc $?"
tail -60 $L/capture_gdb.log | grep -v "^\[New Thread\|^\[Thread" | tail -45
timeout 20 python3 .dbg/capture_repro.py warm > $L/capture_warm.log 2>&1; echo "capture warm rc $?"; tail -5 $L/capture_warm.log
(cd tests && timeout 35 python3 -m pytest -q -x -k "cuda and send_nobody_waited" test_point_to_point.py > $L/p2p.log 2>&1; echo "p2p rc $?"; tail -3 $L/p2p.log)
HCA_FATAL_STACKS=1 PYTHONPATH=$PWD/.dbg timeout 45 python3 -m torch_hca.check --device cuda --world-sizes 2 --log $L/check-ranks.log > $L/check-out.log 2>&1; echo "check rc $?"
grep -v "^\s*$" $L/check-out.log | grep -v "^W11" | head -80
tail -5 $L/check-ranks.log
echo "total $(( $(date +%s) - t0 )) s"
