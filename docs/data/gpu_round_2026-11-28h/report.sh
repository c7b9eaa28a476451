#!/usr/bin/env bash
# Rebuilds this round's summaries and plots (a CPU is enough). Twenty-fifth round of 2026-11-28: one machine of two
# H200s (four calls, kept warm), Qwen3-30B-A3B (dummy weights), ShareGPT-like, both modes launched one ahead, with the
# padded rows of piecewise steps sent to no expert and bullet's prefill batches sized for 32 prompts: bullet at 52
# (seeds 100-102), chunked-2048 at 46-50; bullet on the code-like load at 14 (seed 100):
#   bash docs/data/gpu_round_2026-11-28h/report.sh
set -eu -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
. scripts/round_report.sh  # report NAME TPOT_MS PATH...
R=docs/data/gpu_round_2026-11-28h/h200
report moe-one-machine 50 $R/moe-chunked-2048-overlap_steps-true-chunked__sharegpt-tpot50 \
  $R/moe-bullet-2048-overlap_steps-true-bullet__sharegpt-tpot50
report moe-code 50 $R/moe-bullet-2048-overlap_steps-true-bullet__azure-code-tpot50
# bullet at 52 req/s, seed 100: its two phases window by window and its prefill batches' line per SM count
bullet-trt bench timeline $R/moe-bullet-2048-overlap_steps-true-bullet__sharegpt-tpot50/iterations_bullet_1795867073_call1_gpu1.jsonl.gz \
  >$R/moe-one-machine/timeline_bullet_52_seed100.md
