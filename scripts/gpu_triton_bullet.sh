#!/usr/bin/env bash
# The real tritonserver on a GPU in bullet mode: two MPS-client workers on green-context
# partitions behind model_repository/bullet, a concurrent HTTP load, then the iteration log's
# split summary and plot. tritonserver comes from an archive of the nvidia-pytriton wheel in .whl/ (GPU machines without registry access).
# Usage: OUT=<dir> bash scripts/gpu_triton_bullet.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bullet-gpu}
mkdir -p "$out"
source scripts/gpu_server_env.sh || exit 1
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
mps_env=$(timeout 30 bash scripts/start_mps.sh) && eval "$mps_env" || { echo "MPS daemon did not start"; exit 1; }
engine=${ENGINE:-/tmp/engines/llama-3.1-8b}
[ -f "$engine/engine.yaml" ] || python3 build_engines.py --dummy-weights --arch llama-3.1-8b --out "$engine" --max-model-len 4096
cp docs/data/perf_model_h200_llama-3.1-8b.yaml "$engine/perf_model.yaml"
log="$out/triton_iterations.jsonl"; rm -f "$log"
/tmp/venv/bin/python -m bullet_trt.tools.cli serve --engine-dir "$engine" --set serve.mode=bullet --set serve.partitioner=green \
  --set serve.iteration_log="$log" ${SERVER_ARGS:-} > /tmp/tritonserver.log 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; sleep 5; kill -9 $server 2>/dev/null; KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -sf localhost:8000/v2/models/bullet/ready >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "tritonserver exited"; tail -30 /tmp/tritonserver.log; exit 1; }
  sleep 1
done
curl -sf localhost:8000/v2/models/bullet/ready >/dev/null || { echo "not ready"; tail -30 /tmp/tritonserver.log; exit 1; }
echo "== model ready; MPS clients: $(echo get_server_list | nvidia-cuda-mps-control | head -1)"
timeout 300 python3 scripts/gpu_triton_load.py --requests ${REQUESTS:-64} --threads 24 | tee "$out/triton_load.json"
curl -s localhost:8002/metrics | grep -E "^bullet_(kv_blocks|prefill_sms|decode_sms|requests)" | tee "$out/triton_metrics.txt"
python3 - "$log" <<'PY'
import collections, json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
c = collections.Counter((r["phase"], r["sms"]) for r in recs)
changes = sum(1 for a, b in zip(recs, recs[1:]) if a["phase"] == b["phase"] == "decode" and a["sms"] != b["sms"])
print("iterations", len(recs), "by (phase, SMs):", dict(sorted(c.items())), "decode split changes:", changes)
PY
tail -c 20000 /tmp/tritonserver.log > "$out/tritonserver_tail.log"
python3 -m bullet_trt.tools.bench.plot_iterations "$log" -o "$out/triton_sm_split.png" --title "tritonserver, bullet mode, H200" | tail -1
