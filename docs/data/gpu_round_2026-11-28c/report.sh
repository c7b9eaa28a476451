#!/usr/bin/env bash
# Rebuilds this round's summary.md and plots (a CPU is enough). Twentieth round of 2026-11-28: one machine of four
# H200s (host G again, four calls kept warm), the code of main at 35f46c2. Qwen3-30B-A3B with both modes launched one
# ahead: chunked-1024's edge above 32 and 34's seeds, chunk 2048 from 34 to 40, bullet's 40 again with its
# iteration log, the code-like load; the dense chunked-1024 one ahead at 48 and 50; bullet at TPOT <= 40 ms at 50
# with the split planned a step ahead and with prefill's piecewise graphs:
#   bash docs/data/gpu_round_2026-11-28c/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28c/h200
B=docs/data/gpu_round_2026-11-28b/h200
# Both modes' ShareGPT-like runs on the MoE from the nineteenth round and this one (both on host G; bullet's 40 at seed
# 100 ran in both: the compare reads each result file as its own run).
report moe-both-modes 50 $B/moe-chunked-tpot50-overlap $R/moe-chunked1024-tpot50-overlap \
  $R/moe-chunked2048-tpot50-overlap $B/moe-bullet-tpot50-overlap $R/moe-bullet-tpot50-overlap
report moe-azure-code-both-modes 50 $R/moe-azure-code-chunked1024-tpot50-overlap $R/moe-azure-code-bullet-tpot50-overlap
# The dense model: chunked-1024 one ahead above 44 (the nineteenth round's 44, 46 and 48 beside this round's), scored at
# both TPOT SLOs (chunked's server never reads it); bullet at TPOT <= 40 ms at 50.
report dense-chunked-tpot50 50 $B/chunked-tpot50-overlap $R/chunked1024-tpot50-overlap
report dense-tpot40 40 $B/chunked-tpot50-overlap $R/chunked1024-tpot50-overlap $R/chunked512-tpot40-overlap \
  $R/chunked1024-tpot40-plain $R/bullet-tpot40-split-ahead-overlap $R/bullet-tpot40-piecewise-overlap
report dense-azure 50 $R/azure-code-chunked1024-tpot50-overlap $R/azure-code-bullet-tpot50-overlap \
  $R/azure-conv-bullet-tpot50-overlap
