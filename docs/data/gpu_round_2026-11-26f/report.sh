#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough), each over this round's runs and
# the earlier H100 rounds' runs under the protocol at the same TPOT SLO (bullet with the plan at
# its default 0.85, graphed chunked-1024), so one table holds every mode's ladder of rates:
#   bash docs/data/gpu_round_2026-11-26f/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
D=docs/data
R=$D/gpu_round_2026-11-26f/h100
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
report dense 50 $R/dense $D/gpu_round_2026-11-25c/h100x2/serve
report dense-tpot40 40 $R/dense-tpot40 $D/gpu_round_2026-11-25d/h100x2/serve
report azure-conv 50 $R/azure-conv $D/gpu_round_2026-11-26c/h100/bullet-2048-bullet__azure-conv__rate1[69]__seed100.json.xz \
  $D/gpu_round_2026-11-26c/h100/chunked-1024-chunked__azure-conv__rate1[69]__seed100.json.xz
