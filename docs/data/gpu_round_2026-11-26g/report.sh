#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). The H200's table holds this round's
# runs beside the fifth round's bullet (plan 0.85) and chunked-1024 at TPOT <= 40 ms; the H100's
# hold this round's runs alone: calls 2 and 3 ran with the workers' allocators capped (taken out
# since), so their runs are not pooled with the sixth round's under one label:
#   bash docs/data/gpu_round_2026-11-26g/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
D=docs/data
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=$D/gpu_round_2026-11-26g/h200
report dense-tpot40 40 $R/dense-tpot40 $D/gpu_round_2026-11-26e/h200/dense-tpot40
report moe-azure 50 $R/moe-azure-conv $R/moe-azure-code
R=$D/gpu_round_2026-11-26g/h100
report dense-tpot40 40 $R/dense-tpot40
report dense-tpot40-60s 40 $R/dense-tpot40-60s
report dense 50 $R/dense
R=$D/gpu_round_2026-11-26g/h100-single
report dense-tpot40 40 $R/dense-tpot40
