#!/usr/bin/env bash
# Stop the private CUDA MPS control daemon started by scripts/start_mps.sh.
#
# Idempotent: exits 0 when no daemon answers on the pipe directory. The daemon waits for
# its running clients to exit before it quits, so stop the workers first.
#
# Env:    CUDA_MPS_PIPE_DIRECTORY  default /tmp/bullet-mps-$USER/pipe
#         KILL_MPS_TIMEOUT         seconds to wait for the daemon to exit (default 30)
# Exit:   0 stopped or not running, 1 still running after the timeout, 2 nvidia-cuda-mps-control missing.
set -u
user=${USER:-$(id -un 2>/dev/null || id -u)}
base=/tmp/bullet-mps-$user
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-$base/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-$base/log}
limit=${KILL_MPS_TIMEOUT:-30}

say() { echo "kill_mps: $*" >&2; }
answers() {
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] &&
    echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1
}

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  say "nvidia-cuda-mps-control not found on PATH"
  exit 2
fi
if ! answers; then
  say "no MPS daemon running (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
  exit 0
fi
echo quit | timeout "$limit" nvidia-cuda-mps-control >/dev/null 2>&1
for _ in $(seq 1 $((limit * 5))); do
  if ! answers; then
    say "MPS daemon stopped (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
    exit 0
  fi
  sleep 0.2
done
say "MPS daemon still running after ${limit}s: are clients still running? log:"
tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" >&2 2>/dev/null
exit 1
