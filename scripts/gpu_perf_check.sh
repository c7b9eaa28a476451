#!/usr/bin/env bash
# Engine performance on a GPU: kernel-level parity tests, the `bench kernels` table on a
# dummy-weight Llama-3.1-8B, and the performance-model calibration (held-out error).
# Usage: OUT=<dir> bash scripts/gpu_perf_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bullet-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
engine=${ENGINE:-/tmp/engines/llama-3.1-8b}
echo "== engine GPU tests (Triton kernels)"
timeout 240 python3 -m pytest -p no:cacheprovider -q tests/test_gpu.py 2>&1 | tail -4
[ -f "$engine/engine.yaml" ] || python3 build_engines.py --dummy-weights --arch llama-3.1-8b --out "$engine" --max-model-len 4096
echo "== bench kernels"
timeout 240 python3 -m bullet_trt.tools.bench.kernel_bench --engine-dir "$engine" --json "$out/kernel_bench.json" 2>&1 | tee "$out/kernel_bench.log" | tail -8
[ -n "${SKIP_CALIBRATE:-}" ] && exit 0
echo "== calibrate"
timeout 300 python3 build_engines.py --profile --out "$engine" 2>&1 | tee "$out/calibrate.log" | tail -3
cp "$engine/perf_model.yaml" "$engine/perf_profile.json" "$out/" 2>/dev/null
