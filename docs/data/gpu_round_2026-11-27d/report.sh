#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Fourteenth round of 2026-11-27: one machine of
# two H200s (three calls kept warm) and one of one H100 (two calls): the decode worker's move to a new split
# without a drain (`OverlappedDecode.move_to`) and the sampling kernel for wide nuclei on the GPU (tests and
# bench decode-overlap, decode-overlap/), the overlapped loop at TPOT <= 40 ms on the H200 (50-52 req/s) and on
# the H100 (44 req/s):
#   bash docs/data/gpu_round_2026-11-27d/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
for gpu in h200 h100; do
  R=docs/data/gpu_round_2026-11-27d/$gpu
  report dense-tpot40-overlap 40 $R/dense-tpot40-overlap
done
