#!/usr/bin/env bash
# Rebuilds this round's summaries and plots (a CPU is enough). Twenty-third round of 2026-11-28: three machines of four
# H200s (one call each), Qwen3-30B-A3B (dummy weights), ShareGPT-like, both modes launched one ahead: the MoE tile
# tables tuned on green partitions of 100 and 68 SMs; bullet at 50 with them (and a calibration measured again with
# them) and, on one machine, without them beside with them; chunked-2048 at 42 and 44 over three seeds; bullet at 52
# with its iteration log, chunked-2048 at 42 and 44 with theirs; the code-like load's bullet 12 and chunked-1024 14:
#   bash docs/data/gpu_round_2026-11-28f/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28f/h200
# Both modes on this round's machines: every bullet run at 50 (with the partition tables, twice at seed 100 on two
# machines, and without them) shares one label, so its mean is over all five
report moe-this-round 50 $R/moe-chunked2048-tpot50-overlap $R/moe-bullet-tpot50-overlap $R/moe-bullet-tpot50-overlap-call3 \
  $R/moe-bullet-tpot50-overlap-no-partition-tables
# the partition tables' A/B on one machine (call 3): seed 100 with them, seeds 100-101 without
report moe-partition-tables 50 $R/moe-bullet-tpot50-overlap-call3 $R/moe-bullet-tpot50-overlap-no-partition-tables
# the code-like load: bullet at 12 and chunked-1024 at 14 (this round), chunked-1024 at 12 (twenty-first round)
report moe-azure-code 50 docs/data/gpu_round_2026-11-28d/h200/moe-azure-code-chunked1024-tpot50-overlap \
  $R/moe-azure-code-chunked1024-tpot50-overlap $R/moe-azure-code-bullet-tpot50-overlap
