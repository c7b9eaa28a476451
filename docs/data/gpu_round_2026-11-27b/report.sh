#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Twelfth round of 2026-11-27: a host of
# four H200s, four calls kept warm (the decode worker's steps launched one ahead at TPOT <= 40 ms, both
# modes' code-like edge on one host, TPOT <= 50 ms with decode planned at 1.5); the H100's
# decode-overlap bench is in h100/decode-overlap, its own printout:
#   bash docs/data/gpu_round_2026-11-27b/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-27b/h200
report dense-tpot40-overlap 40 $R/dense-tpot40-overlap
report azure-code 50 $R/azure-code
report dense-tpot50 50 $R/dense-tpot50
report moe-azure-code 50 $R/moe-azure-code
