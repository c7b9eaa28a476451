#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Fifteenth round of 2026-11-27: two machines of
# H200s (host A: four GPUs, calls 1-3 kept warm; host B: two GPUs, call 4): chunked-1024 with its steps launched
# one ahead (decode.overlap_steps) at TPOT <= 40 ms from 34 to 44 req/s, bullet's overlapped loop from 46 to 51,
# and at 51 the late launch (decode.overlap_launch_late) and decode moved ahead of a gathering batch
# (serve.split_ahead), each beside its iteration log:
#   bash docs/data/gpu_round_2026-11-27e/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
for host in h200-host-a h200-host-b; do
  R=docs/data/gpu_round_2026-11-27e/$host
  report chunked-tpot40-overlap 40 $R/chunked-tpot40-overlap
  report bullet-tpot40-overlap 40 $R/bullet-tpot40-overlap
done
R=docs/data/gpu_round_2026-11-27e/h200-host-a
report bullet-tpot40-late-launch 40 $R/bullet-tpot40-late-launch
report bullet-tpot40-split-ahead 40 $R/bullet-tpot40-split-ahead
# both modes on host A in one table, with bullet's ratio to chunked's sustained rate
report tpot40-both-modes 40 $R/chunked-tpot40-overlap $R/bullet-tpot40-overlap
