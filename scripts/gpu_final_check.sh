#!/usr/bin/env bash
# Re-checks on a GPU after engine changes: the GPU test suite (Triton kernels, graphs, CUDA
# IPC), and `bullet-trt serve --start-mps` in bullet mode answering over HTTP with an
# iteration log that carries NVML utilization.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bullet-gpu}
mkdir -p "$out" /tmp/site
export PYTHONUNBUFFERED=1
echo "== GPU tests"
PYTHONPATH=$PWD timeout 240 python3 -m pytest -p no:cacheprovider -q tests/test_gpu.py tests/test_triton_kernels.py 2>&1 | tail -3
source scripts/gpu_server_env.sh || exit 1
engine=/tmp/engines/llama-3.1-8b
python3 build_engines.py --dummy-weights --arch llama-3.1-8b --out "$engine" --max-model-len 4096 >/dev/null
cp docs/data/perf_model_h200_llama-3.1-8b.yaml "$engine/perf_model.yaml"
echo "== bullet-trt serve --start-mps"
/tmp/venv/bin/python -m bullet_trt.tools.cli serve --start-mps --engine-dir "$engine" --set serve.mode=bullet \
  --set serve.iteration_log="$out/final_iterations.jsonl" > /tmp/serve.log 2>&1 &
server=$!
for _ in $(seq 1 180); do curl -sf localhost:8000/v2/models/bullet/ready >/dev/null && break; sleep 1; done
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/tmp/bullet-mps-$(id -un)/pipe nvidia-cuda-mps-control
timeout 120 python3 scripts/gpu_triton_load.py --requests 16 --threads 8
kill -INT $server; wait $server; echo "serve exited with $?"
ps aux | grep -c "[n]vidia-cuda-mps-control" | sed 's/^/MPS control daemons left: /'
head -c 600 "$out/final_iterations.jsonl"; echo
grep -E "bullet-trt:|Error|error" /tmp/serve.log | head -5
