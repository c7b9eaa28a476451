#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Seventeenth round of 2026-11-27, the attention
# metadata built in numpy: one machine of four H200s (host E, call 1) and one of one H100 (calls 2-5, kept warm):
# chunked-1024 launched one ahead (decode.overlap_steps) and bullet's overlapped loop (plan 1.5) at both TPOT SLOs
# and on the Azure-like loads on the H200; both modes' edges at TPOT <= 50 ms and chunked's at TPOT <= 40 ms on the H100:
#   bash docs/data/gpu_round_2026-11-27g/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-27g/h200-host-e
report chunked-tpot40-overlap 40 $R/chunked-tpot40-overlap
report tpot50-both-modes 50 $R/chunked-tpot50-overlap $R/bullet-tpot50-overlap
report azure-code-both-modes 50 $R/azure-code-chunked-tpot50-overlap $R/azure-code-bullet-tpot50-overlap
report azure-conv-chunked-tpot50-overlap 50 $R/azure-conv-chunked-tpot50-overlap
R=docs/data/gpu_round_2026-11-27g/h100
# chunked's 44 and 48 here beside bullet's 44 and 46 of the fourteenth and sixteenth rounds (other H100 hosts)
report tpot40-both-modes 40 $R/chunked-tpot40-overlap docs/data/gpu_round_2026-11-27d/h100/dense-tpot40-overlap \
  docs/data/gpu_round_2026-11-27f/h100/bullet-tpot40-overlap
report tpot50-both-modes 50 $R/chunked-tpot50-overlap $R/bullet-tpot50-overlap
