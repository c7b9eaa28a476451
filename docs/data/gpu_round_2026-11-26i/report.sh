#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). The H200's dense tables hold this
# round's runs beside the fifth round's graphed chunked-1024 (and bullet at the default plan) under
# the same protocol; the A/B of the decode step's host-time cut (one GPU, one seed, the code before
# it, then the current) stays apart, its two runs carrying the same label; the Azure-like loads
# hold this round's runs alone:
#   bash docs/data/gpu_round_2026-11-26i/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
D=docs/data
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=$D/gpu_round_2026-11-26i/h200
report dense-tpot40 40 $R/dense-tpot40 $D/gpu_round_2026-11-26e/h200/dense-tpot40
report dense 50 $R/dense $D/gpu_round_2026-11-26e/h200/dense
report dense-tpot40-ab/current 40 $R/dense-tpot40-ab/current
report dense-tpot40-ab/code_3599cc7 40 $R/dense-tpot40-ab/code_3599cc7
report azure-conv 50 $R/azure-conv
report azure-code 50 $R/azure-code
