#!/usr/bin/env bash
# Engine-core evidence on a CUDA machine: environment, then the GPU parity and CUDA IPC tests.
# Usage: bash scripts/gpu_engine_check.sh [pytest args]   (OUT=<dir> keeps the log)
set -o pipefail
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
PYTHONUNBUFFERED=1 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu.py "$@" 2>&1 | tee "$out/gpu_engine_tests.log"
