#!/usr/bin/env bash
# Lists of GPU work side by side on a machine of several GPUs, one list per GPU:
#
#   GPU_RUN_DIR=/tmp/gr bash scripts/gpu_lists.sh 'COMMANDS FOR GPU 0' 'COMMANDS FOR GPU 1' ...
#
# List N is a bash command line run with CUDA_VISIBLE_DEVICES=N and OUT=$OUT/gpuN (its output
# also in $OUT/gpuN/pair.log, and all of $OUT/gpuN packed into $OUT/gpuN.tar.gz at the end),
# typically `bash scripts/gpu_run.sh ...` calls, e.g. a GPU test and a bench on one GPU while
# the others serve stages of a round's run.sh; there must be no more lists than GPUs. The
# set-up they share is done once, first: the carried wheels' venv in $GPU_RUN_DIR (two
# gpu_run.sh starting at once would both install it), the dummy-weight engines that
# $PREBUILD names ("llama-3.1-8b qwen3-30b-a3b", default the first; two lists building one
# engine directory at once would race) and one MPS daemon, which no list stops (a gpu_run.sh
# stops only the daemon it started itself). Exit status: the first failing list's.
set -u -o pipefail
[ $# -ge 1 ] || { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${GPU_RUN_DIR:?set GPU_RUN_DIR, the directory the lists share}"
export GPU_RUN_DIR
OUT=${OUT:-./out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU')
[ "$#" -le "$gpus" ] || { echo "gpu_lists: $# lists for $gpus GPUs" >&2; exit 2; }
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

pids=()
lists=$#
for ((gpu = 0; gpu < lists; gpu++)); do
  mkdir -p "$OUT/gpu$gpu"
  CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/gpu$gpu bash -c "$1" >"$OUT/gpu$gpu/pair.log" 2>&1 &
  pids+=($!)
  shift
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid"
  status=$?
  [ $rc -eq 0 ] && rc=$status
done
for ((gpu = 0; gpu < lists; gpu++)); do echo "== gpu$gpu"; tail -n 40 "$OUT/gpu$gpu/pair.log"; done
# one archive per GPU and none of the set-up's files: few files to copy back
rm -rf "$OUT/setup"
for ((gpu = 0; gpu < lists; gpu++)); do
  tar czf "$OUT/gpu$gpu.tar.gz" -C "$OUT" "gpu$gpu" && rm -rf "${OUT:?}/gpu$gpu"
done
exit $rc
