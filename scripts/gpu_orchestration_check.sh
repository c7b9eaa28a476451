#!/usr/bin/env bash
# Bullet orchestration on a GPU: private MPS daemon, a dummy-weight Llama-3.1-8B engine, the
# bullet mode with green-context partitions, then the split timeline plot.
# Usage: OUT=<dir> bash scripts/gpu_orchestration_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bullet-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
mps_env=$(timeout 30 bash scripts/start_mps.sh) && eval "$mps_env" || { echo "MPS daemon did not start"; exit 1; }
trap 'KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null' EXIT
engine=${ENGINE:-/tmp/engines/llama-3.1-8b}
[ -f "$engine/engine.yaml" ] || python3 build_engines.py --dummy-weights --arch llama-3.1-8b --out "$engine" --max-model-len 4096
timeout ${DEMO_TIMEOUT:-240} python3 scripts/gpu_bullet_demo.py "$engine" "$out" --mode bullet \
  --set serve.partitioner=green "$@" 2>&1 | tee "$out/bullet_demo.log"
python3 -m bullet_trt.tools.bench.plot_iterations "$out/iterations_bullet.jsonl" -o "$out/sm_split_bullet.png" 2>&1 | tail -1
