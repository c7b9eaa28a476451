#!/usr/bin/env bash
# Two lists of GPU work side by side on a machine of two GPUs, one list per GPU:
#
#   GPU_RUN_DIR=/tmp/gr bash scripts/gpu_pair.sh 'COMMANDS FOR GPU 0' 'COMMANDS FOR GPU 1'
#
# Each list is a bash command line run with CUDA_VISIBLE_DEVICES=N and OUT=$OUT/gpuN (its
# output also in $OUT/gpuN/pair.log, and all of $OUT/gpuN packed into $OUT/gpuN.tar.gz at the
# end), typically `bash scripts/gpu_run.sh ...` calls, e.g. a
# GPU test and a bench on one GPU while the other serves a stage of a round's run.sh. The
# set-up they share is done once, first: the carried wheels' venv in $GPU_RUN_DIR (two
# gpu_run.sh starting at once would both install it) and one MPS daemon, which neither list
# stops (a gpu_run.sh stops only the daemon it started itself). Exit status: the first
# failing list's.
set -u -o pipefail
[ $# -eq 2 ] || { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${GPU_RUN_DIR:?set GPU_RUN_DIR, the directory both lists share}"
export GPU_RUN_DIR
OUT=${OUT:-./out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

mps_env=$(timeout 30 bash scripts/start_mps.sh) || { echo "gpu_pair: no MPS daemon" >&2; exit 1; }
eval "$mps_env"
trap 'KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null 2>&1' EXIT
OUT=$OUT/setup bash scripts/gpu_run.sh run true || exit 1

pids=()
for gpu in 0 1; do
  mkdir -p "$OUT/gpu$gpu"
  cmd=$1
  shift
  CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/gpu$gpu bash -c "$cmd" >"$OUT/gpu$gpu/pair.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid"
  status=$?
  [ $rc -eq 0 ] && rc=$status
done
for gpu in 0 1; do echo "== gpu$gpu"; tail -n 60 "$OUT/gpu$gpu/pair.log"; done
# one archive per GPU and none of the set-up's files: few files to copy back
rm -rf "$OUT/setup"
for gpu in 0 1; do tar czf "$OUT/gpu$gpu.tar.gz" -C "$OUT" "gpu$gpu" && rm -rf "${OUT:?}/gpu$gpu"; done
exit $rc
