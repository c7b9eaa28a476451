#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). h100-b's runs shared one host
# (calls 2-4); the sixth-round code's run is kept apart from the current code's, which carry the
# same label, and h100-a's run (another host) apart from both:
#   bash docs/data/gpu_round_2026-11-26h/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
D=docs/data
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=$D/gpu_round_2026-11-26h/h100-b
report dense-tpot40 40 $R/dense-tpot40
report dense-tpot40-r6code 40 $R/dense-tpot40-r6code
R=$D/gpu_round_2026-11-26h/h100-a
report dense-tpot40 40 $R/dense-tpot40
