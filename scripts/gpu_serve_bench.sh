#!/usr/bin/env bash
# The serving comparison on a GPU: tritonserver started once per mode (chunked, bullet,
# static) on a dummy-weight Llama-3.1-8B engine, an open-loop Poisson sweep over gRPC
# streaming per mode, then the table and plots (bullet-trt bench serve --start-server).
# tritonserver and tritonclient come from archives in .whl/ (for GPU machines without registry access), numpy 1.26 for the stub.
# Usage: OUT=<dir> RATES=6,12,18 NUM=120 DATASET=sharegpt bash scripts/gpu_serve_bench.sh
# CALIBRATE="--set k=v ...": calibrate the engine first with the decode profile the server
# runs (build_engines.py --profile), use that model and copy it and its points to $OUT;
# otherwise the calibration kept in docs/data is used.
# TTFT_SLO / TPOT_SLO (ms, default 1000 / 50): the SLOs the runs are scored against and the
# started servers plan for.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bullet-gpu}
mkdir -p "$out"
source scripts/gpu_server_env.sh || exit 1
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
mps_env=$(timeout 30 bash scripts/start_mps.sh) && eval "$mps_env" || { echo "MPS daemon did not start"; exit 1; }
trap 'KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null' EXIT
engine=${ENGINE:-/tmp/engines/llama-3.1-8b}
[ -f "$engine/engine.yaml" ] || python3 build_engines.py --dummy-weights --arch llama-3.1-8b --out "$engine" --max-model-len 4096
if [ -n "${CALIBRATE:-}" ]; then
  timeout 400 python3 build_engines.py --profile --out "$engine" $CALIBRATE 2>&1 | tail -3 || exit 1
  cp "$engine/perf_model.yaml" "$engine/perf_profile.json" "$out/"
else
  cp docs/data/perf_model_h200_llama-3.1-8b.yaml "$engine/perf_model.yaml"
fi
/tmp/venv/bin/python -m bullet_trt.tools.bench.serve_bench --start-server --engine-dir "$engine" \
  --modes ${MODES:-chunked,bullet,static} --set serve.static_prefill_sms=${STATIC_SMS:-64} \
  --dataset ${DATASET:-sharegpt} --rates ${RATES:-12,18,24,30} ${LOAD:---duration 12} \
  --ttft-slo-ms ${TTFT_SLO:-1000} --tpot-slo-ms ${TPOT_SLO:-50} --out "$out/serve" --no-progress ${EXTRA:-} 2>&1 | tail -60
cat "$out/serve/summary.md" 2>/dev/null
tar czf "$out/serve_results.tar.gz" -C "$out" serve && rm -rf "$out/serve"
