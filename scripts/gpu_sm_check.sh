#!/usr/bin/env bash
# SM-partitioning evidence on a GPU machine (about 2 minutes; every step has a timeout,
# 45+15+75+120+15 s < 5 minutes):
#   1. build native/ (make -C native; skips the probe without nvcc, the doctor then uses Triton)
#   2. start the private MPS daemon (scripts/start_mps.sh)
#   3. python -m bullet_trt.tools.doctor: GPU, MPS, partitioners, green splits, the SM-id
#      measurement in one process, and across two MPS clients the SM ids (reported only:
#      MPS renumbers %smid per client) and the GEMM throughput test that decides
#      disjointness (group+remainder vs group+group, 4 phases of 2 s) -> $OUT/sm_doctor.json
#   4. pytest -m gpu tests/test_sm.py                                -> $OUT/sm_tests.log
#   5. stop the daemon (also on failure)
# Usage: bash scripts/gpu_sm_check.sh   (OUT=<dir> keeps the JSON and logs; default /tmp)
# Exit: 0 when the doctor found no problem and the tests passed.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  # it would cap green contexts

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader || true

echo "== make -C native"
timeout 45 make -C native 2>&1 | tee "$out/sm_native_build.log"

echo "== start MPS"
mps_env=$(timeout 15 bash scripts/start_mps.sh)
mps_rc=$?
if [ $mps_rc -eq 0 ]; then
  eval "$mps_env"
  trap 'echo "== stop MPS"; KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh' EXIT
else
  echo "MPS daemon not started (rc $mps_rc): the doctor measures in one process only"
fi

echo "== doctor"
timeout 75 "$PY" -m bullet_trt.tools.doctor --strict --json "$out/sm_doctor.json" 2>&1 | tee "$out/sm_doctor.log"
doctor_rc=$?

echo "== pytest -m gpu tests/test_sm.py"
timeout 120 "$PY" -m pytest -p no:cacheprovider -q -rA -m gpu tests/test_sm.py 2>&1 | tee "$out/sm_tests.log"
tests_rc=$?

echo "doctor rc=$doctor_rc tests rc=$tests_rc (JSON: $out/sm_doctor.json)"
[ $doctor_rc -eq 0 ] && [ $tests_rc -eq 0 ]
