#!/usr/bin/env bash
# Rebuilds this round's summaries and plots (a CPU is enough). Twenty-fourth round of 2026-11-28: one machine of two
# H200s (four calls, kept warm), Qwen3-30B-A3B (dummy weights), ShareGPT-like, both modes launched one ahead, one seed
# (100) per rate but chunked's 48 (seeds 100, 101): bullet with prefill batches of up to 32 prompts at 50-54, bullet
# as shipped before (8) at 50-52, chunked-2048 at 44-50, and bullet with its prompts fused into decode's steps at 52:
#   bash docs/data/gpu_round_2026-11-28g/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28g/h200
report moe-one-machine 50 $R/moe-chunked-2048-overlap_steps-true-chunked__sharegpt-tpot50 \
  $R/moe-bullet-2048-overlap_steps-true-bullet__sharegpt-tpot50 \
  $R/moe-bullet-2048-overlap_steps-true-max_num_seqs-32-bullet__sharegpt-tpot50 \
  $R/moe-bullet-2048-overlap_steps-true-fuse_prefill-always-max_num_seqs-32-piecewise_graph_tokens-512-1024-1536-2048--bullet__sharegpt-tpot50
