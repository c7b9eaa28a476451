#!/usr/bin/env bash
# Installs the performance-model calibrations stored in docs/data
# (perf_model_<gpu>_<arch>.yaml, measured on an H100 and an H200, and
# perf_model_<gpu>_<arch>.<quantization>[.kv-fp8].yaml for quantized experts and an FP8 KV pool) into a dummy-weight engine
# directory of that arch, named for their GPU as a calibration run names them; a server takes
# its own GPU's and its experts' (bullet_trt/spatial/calibration_store.py) and skips measuring it
# at start. A file already there is kept: a calibration this machine measured wins over the stored one.
#   bash scripts/stored_calibrations.sh ENGINE_DIR [ARCH]     (ARCH: llama-3.1-8b by default)
set -eu
engine=${1:?engine directory}
arch=${2:-llama-3.1-8b}
data="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docs/data"
for gpu in h200:nvidia-h200 h100:nvidia-h100-80gb-hbm3; do
  for stored in "$data/perf_model_${gpu%%:*}_$arch".yaml "$data/perf_model_${gpu%%:*}_$arch".*.yaml; do
    [ -f "$stored" ] || continue
    quantization=${stored#"$data/perf_model_${gpu%%:*}_$arch"}  # ".yaml", ".fp8-w8a8.yaml", ".fp8-w8a8.kv-fp8.yaml"
    target=$engine/perf_model.${gpu#*:}$quantization
    if [ ! -f "$target" ]; then
      # copied then renamed: lists on other GPUs may be starting servers on this engine directory
      cp "$stored" "$engine/.perf_model.$$.tmp" && mv -f "$engine/.perf_model.$$.tmp" "$target"
    fi
  done
done
