#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Thirteenth round of 2026-11-27: two hosts of
# four H200s (host A: two calls kept warm; host B: one call, asked for as four H100s and given H200s): the
# banned-token mask's fix on the GPU (tests and bench decode-overlap, decode-overlap/), the decode worker's
# steps launched one ahead against the plain loop at TPOT <= 40 ms, TPOT <= 50 ms with decode planned at 1.5,
# and MoE Azure-code-like runs (host A):
#   bash docs/data/gpu_round_2026-11-27c/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
for host in h200-host-a h200-host-b; do
  R=docs/data/gpu_round_2026-11-27c/$host
  report dense-tpot40-overlap 40 $R/dense-tpot40-overlap
  report dense-tpot40-plain 40 $R/dense-tpot40-plain
  report dense-tpot50 50 $R/dense-tpot50
done
R=docs/data/gpu_round_2026-11-27c/h200-host-a
report moe 50 $R/moe
