# No flags against hand-tuned, one GPU: the served engine sizes itself (serve.sizing=auto,
# serve.mode=auto with the MPS daemon gpu_run.sh starts) against the flags the benchmarks used.
# Prepared with: mkdir tmp_run && git archive HEAD | gzip > tmp_run/head.tar.gz
# Run with: RATE=42 bash scripts/gpu_run.sh run bash tmp_run/sizing.sh (this file in tmp_run/).
set -u
R=${RATE:?}
G="--set decode.cuda_graph_batch_sizes=[1,2,4,8,16,32,48,64,96,128,160,192,256,320,384,448,512,640,768,896,1024] --set decode.max_num_seqs=1024 --set serve.chunk_size=2048"
top=$OUT
mkdir -p /tmp/head && tar xzf tmp_run/head.tar.gz -C /tmp/head && ln -sfn "$PWD/.whl" /tmp/head/.whl
cd /tmp/head
export GPU_RUN_DIR=/tmp/gr
unset ENGINE
OUT=$top/noflag MODES=auto RATES=$R LOAD="--duration 60" bash scripts/gpu_run.sh serve-compare --label noflag 2>&1 | grep "req/s:" | tail -3
tar xzf $top/noflag/serve_results.tar.gz -O --wildcards '*server_*.log' 2>/dev/null | grep -a "sized for this GPU\|serve.mode=auto\|MPS" | head -5
OUT=$top/tuned MODES=bullet RATES=$R LOAD="--duration 60" EXTRA="$G" bash scripts/gpu_run.sh serve-compare --label tuned 2>&1 | grep "req/s:" | tail -3
