#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). The H100's Azure-like loads under the
# protocol; call 3's second runs of the same seeds on the same host stay apart (h100/repeat/), as
# the run-to-run spread at the edge, not more seeds:
#   bash docs/data/gpu_round_2026-11-27/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-27/h100
report azure-conv 50 $R/azure-conv
report azure-code 50 $R/azure-code
report repeat/azure-conv 50 $R/repeat/azure-conv
report repeat/azure-code 50 $R/repeat/azure-code
# Eleventh round (a host of four H200s, three calls kept warm): the H200's code-like edge, prompts fused
# into decode's steps, and the split planned for prefill within 0.75 of the TTFT SLO:
R=docs/data/gpu_round_2026-11-27/h200
report azure-code 50 $R/azure-code
report azure-code-ttft-plan-0.75 50 $R/azure-code-ttft-plan-0.75
report azure-code-fused 50 $R/azure-code-fused
report azure-conv 50 $R/azure-conv
report dense-tpot40 40 $R/dense-tpot40
report dense-tpot40-levers 40 $R/dense-tpot40-levers
report dense-tpot50 50 $R/dense-tpot50
