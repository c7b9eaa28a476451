#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough), each over this round's runs
# and the earlier rounds' runs of the same servers under the protocol, so one table holds a
# mode's whole ladder of rates:
#   bash docs/data/gpu_round_2026-11-26e/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
D=docs/data
R=$D/gpu_round_2026-11-26e/h200
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
report dense 50 $R/dense \
  $D/gpu_round_2026-11-26/h200/dense/*rate32__seed10[0-2].json.xz \
  $D/gpu_round_2026-11-26/h200/dense/bullet-2048-bullet__sharegpt__rate40__seed10[01].json.xz \
  $D/gpu_round_2026-11-26c/h200/dense/bullet-2048-bullet__sharegpt__rate40__seed102.json.xz
report dense-tpot40 40 $R/dense-tpot40
report moe 50 $R/moe \
  $D/gpu_round_2026-11-26/h200/moe/*sharegpt__rate34__seed10[0-2].json.xz \
  $D/gpu_round_2026-11-26d/h200/moe/*sharegpt__rate36__seed10[0-2].json.xz \
  $D/gpu_round_2026-11-25f/h200/serve/moe-chunked-1024-chunked__sharegpt__rate24__seed10[01].json.xz \
  $D/gpu_round_2026-11-26c/h200/moe/*azure-conv__rate18__seed10[0-2].json.xz \
  $D/gpu_round_2026-11-26c/h200/moe/moe-chunked-1024-chunked__azure-conv__rate12__seed10[0-2].json.xz \
  $D/gpu_round_2026-11-26d/h200/moe/moe-chunked-2048-chunked__azure-conv__rate15__seed10[0-2].json.xz
