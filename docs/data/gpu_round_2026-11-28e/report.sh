#!/usr/bin/env bash
# Rebuilds this round's summaries and plots (a CPU is enough). Twenty-second round of 2026-11-28: one machine of four
# H200s (host G, four calls kept warm), Qwen3-30B-A3B (dummy weights) with the tuned MoE tiles, ShareGPT-like, both
# modes launched one ahead: seeds 101 and 102 at both modes' edges of the twenty-first round, bullet on a calibration
# measured with the tuned tiles (the twenty-first round's bullet ran on one timed with the untuned tiles), chunked-2048
# down to where its three seeds hold, chunked-1024 at 44 and 46, and chunked-1024 on the code-like load at 14:
#   bash docs/data/gpu_round_2026-11-28e/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28e/h200
D=docs/data/gpu_round_2026-11-28d/h200
# Both modes over three seeds with the tuned tiles: chunked-2048's seed 100 (34-52) from the twenty-first round, its
# seeds 101-102 and its 40-42 from this one; bullet only from this round (fresh calibration).
report moe-three-seeds 50 $D/moe-chunked2048-tpot50-overlap $R/moe-chunked2048-tpot50-overlap $R/moe-bullet-tpot50-overlap
# the best chunk size: chunked-1024 beside chunked-2048 at 44 and 46 (seed 100)
report moe-chunk-sizes 50 $D/moe-chunked2048-tpot50-overlap $R/moe-chunked1024-tpot50-overlap
# the code-like load, chunked-1024 at 12 (twenty-first round) and 14 (this round)
report moe-azure-code-chunked 50 $D/moe-azure-code-chunked1024-tpot50-overlap $R/moe-azure-code-chunked1024-tpot50-overlap
