#!/usr/bin/env bash
# Installs the performance-model calibrations measured on the lent GPU models
# (docs/data/perf_model_<gpu>_llama-3.1-8b.yaml) into a dummy-weight Llama-3.1-8B engine
# directory, named for their GPU as a calibration run names them; a server takes its own GPU's
# (bullet_trt/spatial/calibration_store.py). A file already there is kept: a calibration this
# machine measured wins over the stored one.
#   bash scripts/stored_calibrations.sh ENGINE_DIR
set -eu
engine=${1:?engine directory}
data="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docs/data"
for gpu in h200:nvidia-h200 h100:nvidia-h100-80gb-hbm3; do
  [ -f "$engine/perf_model.${gpu#*:}.yaml" ] \
    || cp "$data/perf_model_${gpu%%:*}_llama-3.1-8b.yaml" "$engine/perf_model.${gpu#*:}.yaml"
done
