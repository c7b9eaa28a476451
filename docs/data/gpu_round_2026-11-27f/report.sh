#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Sixteenth round of 2026-11-27: two machines of
# H200s (host C: four GPUs, call 1; host D: two GPUs, call 2) and one of one H100 (calls 3-5, kept warm): chunked-1024
# launched one ahead (decode.overlap_steps) at TPOT <= 50 ms on both H200 hosts and at TPOT <= 40 ms on the H100
# (28-36 req/s), chunk 2048 at TPOT <= 40 ms, bullet's overlapped loop at its TPOT <= 40 ms edge on each GPU (with and
# without the late launch on host C) and at TPOT <= 50 ms on host D:
#   bash docs/data/gpu_round_2026-11-27f/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-27f/h200-host-c
report chunked-tpot50-overlap 50 $R/chunked-tpot50-overlap
report chunked2048-tpot40-overlap 40 $R/chunked2048-tpot40-overlap
report bullet-tpot40-overlap 40 $R/bullet-tpot40-overlap
report bullet-tpot40-late-launch 40 $R/bullet-tpot40-late-launch
R=docs/data/gpu_round_2026-11-27f/h200-host-d
report chunked-tpot50-overlap 50 $R/chunked-tpot50-overlap
report bullet-tpot50-overlap 50 $R/bullet-tpot50-overlap
# both modes on host D in one table, with bullet's ratio to chunked's sustained rate
report tpot50-both-modes 50 $R/chunked-tpot50-overlap $R/bullet-tpot50-overlap
R=docs/data/gpu_round_2026-11-27f/h100
report chunked-tpot40-overlap 40 $R/chunked-tpot40-overlap
report bullet-tpot40-overlap 40 $R/bullet-tpot40-overlap
# both modes on the H100: this round's chunked and bullet's 46 beside the fourteenth round's 44 (another H100 host)
report tpot40-both-modes 40 $R/chunked-tpot40-overlap $R/bullet-tpot40-overlap \
  docs/data/gpu_round_2026-11-27d/h100/dense-tpot40-overlap
