# One GPU round, in stages that each fit one device call (10 minutes) on a warm machine:
#   bash scripts/gpu_run.sh run bash docs/data/gpu_round_2026-11-25/run.sh STAGE
# with GPU_RUN_DIR=/tmp/gr exported so that the venv, the engine and its calibration outlive a
# stage; on a machine of several GPUs, stages side by side with scripts/gpu_lists.sh (lists, or
# a queue of jobs: jobs_h200.txt and jobs_h100.txt beside this file hold the open ones). Stages:
#   check    bench mixed-step (run after `bash scripts/gpu_run.sh tests tests/gpu/test_piecewise_graphs_gpu.py
#            tests/gpu/test_calibration_on_start.py`, whose tests need the machine's own interpreter)
#   calib    the performance model of this GPU for the served decode profile (serve.calibrate's
#            own measurement, timed), copied to $OUT
#   chunked  chunked serving at chunk 2048, eager mixed steps against piecewise graphs, at
#            $RATES (60 s of arrivals each, ShareGPT-like, TTFT <= 1 s, TPOT <= 50 ms)
#   graphs   chunked serving with piecewise graphs only, at each chunk size of $CHUNKS
#   bullet   bullet serving at $RATES, same protocol and flags
#   sizing   no flags (serve.mode=auto, serve.sizing=auto) against the hand-tuned bullet flags
#            at $RATE
#   protocol one mode ($MODE: chunked with piecewise graphs at $CHUNK, or bullet) at $RATE (one
#            rate, or ascending ones: "36,40"), ${REPEATS:-3} seeds from ${SEED:-100} x 120 s of
#            arrivals: the repeated protocol. With --stop-when-decided a rate that cannot reach
#            90% stops its run and skips its other seeds and the higher rates, so a failing rate
#            costs about one minute instead of three runs and their drains (runs of 2026-11-25
#            before it: one (mode, rate) per device call). DURATION=60 REPEATS=1 makes it a quick
#            one-seed sweep that finds where a mode's edge lies before the protocol confirms it.
#            A protocol's seeds spread over GPUs (scripts/gpu_lists.sh, e.g. SEED=101 REPEATS=1 on
#            one GPU) take DECIDE_OVER=3, so that each decides over all three seeds
#   moe      the protocol of `protocol` on the dummy-weight Qwen3-30B-A3B (built first where
#            ${MOE_ENGINE:-$GPU_RUN_DIR/engines/qwen3-30b-a3b} lacks it; weights are made on the
#            GPU at start): $MODE at $RATE, three seeds x 120 s, --stop-when-decided; one H200
#            (61 GB of weights). The engine directory gets the stored H200 calibration
#            (docs/data/perf_model_h200_qwen3-30b-a3b.yaml, measured with the prefill pieces
#            sizing names; a server re-measures one that timed other MoE tiles, and the stage
#            copies the calibration served to $OUT); with FRESH_CALIBRATION=1 the first server
#            measures its own, and a
#            run whose $SETS change how steps run then takes a MOE_ENGINE of its own. Since
#            2026-11-26 sizing plans bullet's decode up to the TPOT SLO for this model
#            (serve.tpot_plan_fraction=1.0; SETS="serve.tpot_plan_fraction=0.85" for the old plan)
#   overlap  bullet at $RATE with the iteration log (GPU-clock stamps), prefill starting at once
#            and waiting for decode's move (serve.prefill_waits_for_split), then `bench overlap`;
#            its two runs need ~9 minutes, so run it where an earlier stage built the engine
#   pair     `protocol` stages side by side on a machine of several GPUs, one per GPU
#            (CUDA_VISIBLE_DEVICES=0, 1, ..., outputs in $OUT/gpu0, $OUT/gpu1, ...): $PAIR holds
#            "MODE:CHUNK:RATE[:SETS] MODE:CHUNK:RATE[:SETS]" (RATE as in protocol, commas
#            allowed; SETS: that stage's $SETS, comma-separated), e.g. one mode with and
#            without an override at the same rate; each
#            stage's server and load generator see only their own GPU, so the two runs share
#            the host's CPUs (unpinned) and nothing on the GPUs
# $LIMIT (seconds, default 590) bounds the protocol, moe and pair stages; without it, $DEADLINE
# (epoch seconds, e.g. DEADLINE=$(( $(date +%s) + 580 )) exported at the start of a device
# call) gives each stage what is left of the call, so stages run one after another on a GPU
# share one call's time and a fresh machine's set-up is taken off the first.
# TOKEN_TIMES=1 keeps every response's time in the results (`bench serve --token-times`), for
# the first gap between tokens that `bullet-trt bench misses` sets apart; ITER_LOG=1 has the
# protocol, moe and pair stages' servers write their iteration log ($OUT/iterations_*.jsonl.gz).
# $SETS ("key=value ..."): engine overrides for the protocol, moe and pair stages' servers,
# each named in the runs' label, e.g. SETS="serve.tpot_plan_fraction=1.0".
# PYTORCH_CUDA_ALLOC_CONF, exported, reaches every process of the server (the engine and its
# workers) and is named in the protocol stages' labels, e.g. expandable_segments:True.
# $CLIENT: bench serve's client options for the protocol and moe stages, named in their labels,
# e.g. CLIENT="--temperature 0.8 --top-p 0.9" (default: greedy).
# Every stage serves $DATASET (default sharegpt; azure-conv, azure-code) at TTFT <= $TTFT_SLO ms
# and TPOT <= $TPOT_SLO ms (defaults 1000 and 50), e.g. the targets' second and third rows:
#   TPOT_SLO=40 PAIR="bullet:2048:36 chunked:1024:26" ... pair   (what two H100s sustained)
#   DATASET=azure-code PAIR="bullet:2048:12 chunked:1024:12" ... pair   (a starting point only:
#   the H200 one-seed runs sustained 14-20 req/s of the Azure-like loads, docs/benchmarks.md)
# The protocol's rates must lie below capacity: a rate above it scores by the run's length
# (docs/benchmarks.md, "The targets under the protocol"); the summary's "last third" columns
# tell the two apart.
set -u
stage=${1:?stage}
G="--set decode.cuda_graph_batch_sizes=[1,2,4,8,16,32,48,64,96,128,160,192,256,320,384,448,512,640,768,896,1024] --set decode.max_num_seqs=1024 --set serve.chunk_size=${CHUNK:-2048}"
# The plain host loop unless SETS names a loop: a sized chunked server launches its steps one
# ahead since the fifteenth round (serving/device_sizing.py), and a run's label names only SETS.
[[ " ${SETS:-} " == *" decode.overlap_steps="* ]] || G="$G --set decode.overlap_steps=false"
PW="--set prefill.piecewise_graph_tokens=[128,256,512,768,1024,1280,1536,1792,2048]"
DATASET=${DATASET:-sharegpt} TTFT_SLO=${TTFT_SLO:-1000} TPOT_SLO=${TPOT_SLO:-50}
COMMON="--start-server --engine-dir $ENGINE --dataset $DATASET --duration 60 --ttft-slo-ms $TTFT_SLO --tpot-slo-ms $TPOT_SLO --no-progress"
SLO_TAG=""  # runs at other SLOs than the targets' first keep them in their label
[ "$TTFT_SLO/$TPOT_SLO" = 1000/50 ] || SLO_TAG="-ttft$TTFT_SLO-tpot$TPOT_SLO"
clocks() { nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader; }
serve() {  # serve LABEL TIMEOUT ARGS...
  local label=$1 limit=$2
  shift 2
  # the budget leaves the server's stop inside the timeout; a run that would not end in it is not started
  timeout "$limit" python -m bullet_trt.tools.cli bench serve $COMMON --label "$label" --out "$OUT/serve" \
    --time-budget-s $((limit - 20)) ${TOKEN_TIMES:+--token-times} "$@" 2>&1 \
    | grep -a -E "req/s|sized for|performance model|Error|error|budget" | tail -8
}
pack() {  # a second stage of the same name in one $OUT gets its own archive, not the first's
  local n=1 name=serve_$stage
  while [ -e "$OUT/$name.tar.gz" ]; do n=$((n + 1)); name=serve_${stage}_$n; done
  [ -d "$OUT/serve" ] && tar czf "$OUT/$name.tar.gz" -C "$OUT" serve && rm -rf "$OUT/serve"
}
repeated() {  # repeated LABEL: $MODE at ascending $RATE, ${REPEATS:-3} seeds x 120 s, decided early
  local graphs="" sets="" set_tag="" kv
  [ "${MODE:?}" = chunked ] && graphs=$PW
  for kv in ${SETS:-}; do  # each override names itself in the label (bench serve slugs it for file names)
    sets="$sets --set $kv"
    set_tag="$set_tag-${kv#*.}"  # serve.tpot_plan_fraction=1.0 -> -tpot_plan_fraction=1.0
  done
  # an allocator setting for every process of the server names itself too
  [ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ] && set_tag="$set_tag-alloc=${PYTORCH_CUDA_ALLOC_CONF//[:,]/_}"
  # and so do the client's options, flag-value pairs ($CLIENT="--temperature 0.8 --top-p 0.9"
  # -> -temperature=0.8-top-p=0.9)
  local client=() i
  read -ra client <<<"${CLIENT:-}"
  for ((i = 0; i + 1 < ${#client[@]}; i += 2)); do set_tag="$set_tag-${client[i]#--}=${client[i + 1]}"; done
  local limit=${LIMIT:-590}
  [ -z "${LIMIT:-}" ] && [ -n "${DEADLINE:-}" ] && limit=$((DEADLINE - $(date +%s) - 10))
  [ "$limit" -gt 30 ] || { echo "run.sh: $((limit)) s left before DEADLINE: $1 not started"; return; }
  local iterations=""  # not in the label: a run with its iteration log is the same run
  [ -n "${ITER_LOG:-}" ] && iterations="--set serve.iteration_log=$OUT/iterations_${MODE}_$(date +%s).jsonl"
  serve "$1-${CHUNK:-2048}$SLO_TAG$set_tag" "$limit" --modes "$MODE" --rates "${RATE:?}" $G $graphs $sets $iterations ${CLIENT:-} \
    --duration "${DURATION:-120}" --repeats "${REPEATS:-3}" --seed "${SEED:-100}" --stop-when-decided \
    ${DECIDE_OVER:+--decide-over "$DECIDE_OVER"}
  [ -n "$iterations" ] && gzip -f "$OUT"/iterations_*.jsonl 2>/dev/null
  pack
}
[ "$stage" = calib ] || bash scripts/stored_calibrations.sh "$ENGINE"  # calib measures this GPU, which a stored file stops (run it first)
clocks
case "$stage" in
  check)
    timeout 220 python -m bullet_trt.tools.cli bench mixed-step --engine-dir "$ENGINE" \
      --json "$OUT/mixed_step.json" 2>&1 | tail -16
    ;;
  calib)
    start=$(date +%s)
    timeout 560 python -c 'import sys
from bullet_trt.config import load_engine_config
from bullet_trt.serving.calibrate_on_start import ensure_calibrated
ensure_calibrated(load_engine_config(sys.argv[1], {"device": "cuda"}))' "$ENGINE" 2>&1 | tail -5
    echo "calibration took $(( $(date +%s) - start )) s"
    cp "$ENGINE"/perf_model.*.yaml "$ENGINE"/perf_profile.*.json "$OUT/" 2>/dev/null
    ;;
  chunked)
    serve chunked-eager 280 --modes chunked --rates "${RATES:?}" $G
    serve chunked-graphs 300 --modes chunked --rates "$RATES" $G $PW
    pack
    ;;
  graphs)
    for chunk in ${CHUNKS:?}; do
      serve chunked-graphs-$chunk 290 --modes chunked --rates "${RATES:?}" $G $PW \
        --set serve.chunk_size=$chunk
    done
    pack
    ;;
  bullet)
    serve bullet 560 --modes bullet --rates "${RATES:?}" $G
    pack
    ;;
  sizing)
    serve noflag 280 --modes auto --rates "${RATE:?}"
    serve tuned 290 --modes bullet --rates "$RATE" $G
    pack
    ;;
  protocol)
    repeated "${MODE:?}"
    ;;
  moe)
    moe_engine=${MOE_ENGINE:-${GPU_RUN_DIR:?}/engines/qwen3-30b-a3b}
    [ -f "$moe_engine/engine.yaml" ] || python build_engines.py --dummy-weights --arch qwen3-30b-a3b \
      --out "$moe_engine" --max-model-len 4096 >/dev/null || exit 1
    # the stored H200 calibration (random prompts, prefill pieces as sizing names them): a
    # server that finds it skips two minutes of measuring, unless it timed other MoE tiles than
    # the GPU's table gives or other step code (stale: the server measures again, ~40 s for the
    # MoE); FRESH_CALIBRATION=1 measures anew
    [ -n "${FRESH_CALIBRATION:-}" ] || bash scripts/stored_calibrations.sh "$moe_engine" qwen3-30b-a3b
    COMMON=${COMMON/--engine-dir $ENGINE/--engine-dir $moe_engine}
    repeated "moe-${MODE:?}"
    # whichever calibration served, so that one measured here can replace the stored file, and
    # its measured points (perf_profile.*.json, when this run measured it), to refit it on a CPU
    cp "$moe_engine"/perf_model.*.yaml "$moe_engine"/perf_profile.*.json "$OUT/" 2>/dev/null
    ;;
  pair)
    gpu=0
    for spec in ${PAIR:?}; do
      IFS=: read -r mode chunk rate sets <<<"$spec"
      mkdir -p "$OUT/gpu$gpu"
      CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/gpu$gpu MODE=$mode CHUNK=$chunk RATE=$rate SETS="${sets//,/ }" \
        bash "$0" protocol >"$OUT/gpu$gpu/stage.log" 2>&1 &
      gpu=$((gpu + 1))
    done
    wait
    for log in "$OUT"/gpu*/stage.log; do echo "== $log"; cat "$log"; done
    ;;
  overlap)
    for wait in false true; do
      serve bullet-wait-$wait 280 --modes bullet --rates "${RATE:?}" $G \
        --set serve.prefill_waits_for_split=$wait --set serve.iteration_log="$OUT/iter_wait_$wait.jsonl"
      python -m bullet_trt.tools.cli bench overlap "$OUT/iter_wait_$wait.jsonl" --json \
        | tee "$OUT/overlap_wait_$wait.json"
      gzip -f "$OUT/iter_wait_$wait.jsonl"
    done
    pack
    ;;
esac
clocks
