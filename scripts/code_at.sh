#!/usr/bin/env bash
# Packs a commit's tree for a GPU machine, where scripts/gpu_run.sh runs it with CODE_AT:
#   bash scripts/code_at.sh COMMIT    -> .whl/code_SHORT.tar.gz; prints CODE_AT=SHORT
# .whl/ travels with the working tree to the GPU machine (and is ignored by git). The rounds'
# GPU data stay out (every docs/data/gpu_round_*/<gpu>/ and serve_* folder): the commit's
# run.sh, job queues and stored calibrations go in. Then, on the GPU machine, the same stage
# with and without CODE_AT=SHORT measures a change against the code before it on one host:
#   GPU_RUN_DIR=/tmp/gr bash scripts/gpu_lists.sh 'S=...; CODE_AT=SHORT bash scripts/gpu_run.sh run $S; bash scripts/gpu_run.sh run $S'
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
short=$(git rev-parse --short=7 "$1^{commit}")
mkdir -p .whl
git archive --format=tar.gz -o ".whl/code_$short.tar.gz" "$short" -- . \
  ':(exclude,glob)docs/data/gpu_round_*/h*/**' ':(exclude,glob)docs/data/serve_*/**'
echo "$(du -h ".whl/code_$short.tar.gz" | cut -f1) .whl/code_$short.tar.gz"
echo "CODE_AT=$short"
