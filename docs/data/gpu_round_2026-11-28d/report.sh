#!/usr/bin/env bash
# Rebuilds this round's summaries and plots (a CPU is enough). Twenty-first round of 2026-11-28: one machine of four
# H200s (host G again, four calls kept warm). Call 1 tuned the fused MoE kernels' tiles (`bench moe-tune`, four
# shards); calls 2-4 served Qwen3-30B-A3B with the tuned table, both modes launched one ahead, seed 100. Dense:
# bullet at TPOT <= 40 ms with the split planned a step ahead at 50 (seeds 101, 102; seed 100 ran in the twentieth
# round) and 52; bullet's plan at 1.5 at 52; chunked-1024 on the conversation-like load at 16:
#   bash docs/data/gpu_round_2026-11-28d/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28d/h200
C=docs/data/gpu_round_2026-11-28c/h200
B=docs/data/gpu_round_2026-11-28b/h200
# The MoE with the tuned tiles: both modes' ShareGPT-like runs of this round only (the twentieth round's ran the
# untuned tiles: see $C/moe-both-modes).
report moe-tuned-both-modes 50 $R/moe-chunked2048-tpot50-overlap $R/moe-bullet-tpot50-overlap
# the code-like load, chunked-1024 at 12 (its 14 in the twentieth round ran the untuned tiles: not beside it)
report moe-azure-code-chunked 50 $R/moe-azure-code-chunked1024-tpot50-overlap
# The dense model at TPOT <= 40 ms: chunked-1024 (nineteenth and twentieth rounds) against bullet with split_ahead
# (seed 100 from the twentieth round, 101 and 102 and rate 52 from this one).
report dense-tpot40 40 $B/chunked-tpot50-overlap $C/chunked1024-tpot50-overlap $C/bullet-tpot40-split-ahead-overlap \
  $R/bullet-tpot40-split-ahead-overlap
report dense-tpot50-plan1.5 50 $R/bullet-tpot50-plan1.5-overlap
report dense-azure-conv 50 $R/azure-conv-chunked1024-tpot50-overlap $C/azure-conv-bullet-tpot50-overlap
