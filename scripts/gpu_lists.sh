#!/usr/bin/env bash
# GPU work side by side on a machine of several GPUs, one worker per GPU:
#
#   GPU_RUN_DIR=/tmp/gr bash scripts/gpu_lists.sh 'COMMANDS FOR GPU 0' 'COMMANDS FOR GPU 1' ...
#   GPU_RUN_DIR=/tmp/gr DEADLINE=EPOCH_SECONDS bash scripts/gpu_lists.sh --queue JOBS[,JOBS...] [GPUS]
#
# Lists: list N is a bash command line run with CUDA_VISIBLE_DEVICES=N and OUT=$OUT/gpuN,
# typically `bash scripts/gpu_run.sh ...` calls, e.g. a GPU test and a bench on one GPU while
# the others serve stages of a round's run.sh; no more lists than GPUs.
# Queue: JOBS holds jobs, `SECONDS COMMAND` a line (scripts/job_queue.sh); of several files
# the first whose `# gpu: NAME` line matches the machine's GPU is taken (job_queue.sh pick),
# none matching stops the call before its set-up. Each of GPUS workers (default: every GPU)
# takes the first job that fits before DEADLINE, runs it on its GPU like a list, and takes
# the next until none fits, so a GPU that finishes early takes more. The jobs left over are
# printed and kept in $OUT/queue.left, to start the next call's queue, with any job that left
# runs unstarted (its time ran out first) after a comment that says so: rerun it whole, or
# only the runs it did not start. A job whose run decides its rate for the protocol's other
# seeds (bench serve --decide-over) drops those seeds' queued jobs (job_queue.sh drop). The
# jobs run or dropped are listed in $GPU_RUN_DIR/jobs_done, and a later call on the same
# machine skips them (job_queue.sh forget), so each call may start from the committed jobs
# file: on a machine still held that is the queue the last call left. Each
# command's output goes to $OUT/gpuN/pair.log too, and all of $OUT/gpuN into
# $OUT/gpuN.tar.gz at the end.
# The set-up they share is done once, first: the carried wheels' venv in $GPU_RUN_DIR (two
# gpu_run.sh starting at once would both install it), the dummy-weight engines that
# $PREBUILD names ("llama-3.1-8b qwen3-30b-a3b", default the first; two workers building one
# engine directory at once would race) and one MPS daemon, which no worker stops (a
# gpu_run.sh stops only the daemon it started itself). Of several workers each runs pinned to
# its own equal slice of the host's CPUs (scripts/cpu_slice.py; GPU_LISTS_PIN=0: unpinned), said
# in the first line of its pair.log. Exit status: the first failing worker's.
set -u -o pipefail
[ $# -ge 1 ] || { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${GPU_RUN_DIR:?set GPU_RUN_DIR, the directory the workers share}"
export GPU_RUN_DIR
OUT=${OUT:-./out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU')
queue=""
if [ "$1" = --queue ]; then
  [ -n "${2:-}" ] || { echo "gpu_lists: --queue needs a jobs file" >&2; exit 2; }
  : "${DEADLINE:?set DEADLINE (epoch seconds): the workers take only the jobs that end before it}"
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  IFS=, read -ra candidates <<<"$2"
  jobs=$(bash scripts/job_queue.sh pick "$gpu_name" "${candidates[@]}") || exit 3
  echo "gpu_lists: $gpus x $gpu_name: the jobs of $jobs"
  workers=${3:-$gpus}
  queue=$OUT/queue
  grep -v '^[[:space:]]*#' "$jobs" >"$queue"  # the workers take from a copy: the repository's file stays whole
  # jobs an earlier call on this machine ran or dropped are not run again (job_queue.sh forget)
  done_jobs=$GPU_RUN_DIR/jobs_done
  bash scripts/job_queue.sh forget "$queue" "$done_jobs" | sed 's/^/gpu_lists: run on this machine by an earlier call, skipped: /'
else
  workers=$#
fi
[ "$workers" -le "$gpus" ] || { echo "gpu_lists: $workers workers for $gpus GPUs" >&2; exit 2; }
mps_env=$(timeout 30 bash scripts/start_mps.sh) || { echo "gpu_lists: no MPS daemon" >&2; exit 1; }
eval "$mps_env"
trap 'KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null 2>&1' EXIT
OUT=$OUT/setup bash scripts/gpu_run.sh run true || exit 1
for arch in ${PREBUILD:-}; do
  [ "$arch" = llama-3.1-8b ] && continue  # gpu_run.sh built it ($ENGINE)
  dir=$GPU_RUN_DIR/engines/$arch
  [ -f "$dir/engine.yaml" ] || OUT=$OUT/setup bash scripts/gpu_run.sh run \
    python build_engines.py --dummy-weights --arch "$arch" --out "$dir" --max-model-len 4096 >/dev/null || exit 1
done

work() {  # work GPU [COMMAND]: the command, or the queue's jobs one after another
  local gpu=$1 cmd rc=0
  if [ -z "$queue" ]; then
    bash -c "$2" || rc=$?
    return $rc
  fi
  local job unstarted
  while job=$(bash scripts/job_queue.sh take "$queue" $((DEADLINE - $(date +%s)))); do
    cmd=${job#*[[:space:]]}
    echo "== gpu_lists: GPU $gpu takes, $((DEADLINE - $(date +%s))) s before DEADLINE: $cmd"
    bash -c "$cmd" 2>&1 | tee "$OUT/job.out" || rc=$?
    # a run that no longer fits before the deadline is not started ("not started" from bench
    # serve or run.sh): the job goes back, beside the ones left, for the next call
    if unstarted=$(grep -a -m1 'not started' "$OUT/job.out"); then
      bash scripts/job_queue.sh put "$queue.unstarted" "$job" "GPU $gpu left runs of this job unstarted: $unstarted"
    else
      bash scripts/job_queue.sh put "$done_jobs" "$job"
    fi
    # a seed that decided its rate for the whole protocol: the rate's other seeds would measure nothing
    if grep -a -q "decided whatever the protocol's other seeds attain" "$OUT/job.out"; then
      bash scripts/job_queue.sh drop "$queue" "$job" | tee -a "$done_jobs" |
        sed "s/^/== gpu_lists: GPU $gpu drops, its seed having decided the rate: /"
    fi
  done
  rm -f "$OUT/job.out"
  return $rc
}

# several workers: each on its own slice of the host's CPUs (scripts/cpu_slice.py says why);
# GPU_LISTS_PIN=0 leaves them unpinned
pin=""
[ "$workers" -gt 1 ] && [ "${GPU_LISTS_PIN:-1}" = 1 ] && command -v taskset >/dev/null && pin=1
pids=()
for ((gpu = 0; gpu < workers; gpu++)); do
  mkdir -p "$OUT/gpu$gpu"
  cpus=""
  [ -n "$pin" ] && cpus=$(python3 scripts/cpu_slice.py "$workers" "$gpu")
  (
    if [ -n "$cpus" ] && taskset -pc "$cpus" "$BASHPID" >/dev/null; then
      echo "== gpu_lists: GPU $gpu's worker runs on CPUs $cpus"
    fi
    CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/gpu$gpu work "$gpu" "${1:-}"
  ) >"$OUT/gpu$gpu/pair.log" 2>&1 &
  pids+=($!)
  [ -z "$queue" ] && shift
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid"
  status=$?
  [ $rc -eq 0 ] && rc=$status
done
for ((gpu = 0; gpu < workers; gpu++)); do echo "== gpu$gpu"; tail -n 40 "$OUT/gpu$gpu/pair.log"; done
if [ -n "$queue" ]; then
  [ -f "$queue.unstarted" ] && cat "$queue.unstarted" >>"$queue" && rm -f "$queue.unstarted" "$queue.unstarted.lock"
  mv "$queue" "$OUT/queue.left" && rm -f "$queue.lock"
  echo "== jobs left in the queue ($OUT/queue.left):"
  grep -v '^[[:space:]]*$' "$OUT/queue.left" || echo "(none)"
fi
# one archive per GPU and none of the set-up's files: few files to copy back
rm -rf "$OUT/setup"
for ((gpu = 0; gpu < workers; gpu++)); do
  tar czf "$OUT/gpu$gpu.tar.gz" -C "$OUT" "gpu$gpu" && rm -rf "${OUT:?}/gpu$gpu"
done
exit $rc
