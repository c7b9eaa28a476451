#!/usr/bin/env bash
# Start a private CUDA MPS control daemon for bullet_trt's prefill and decode workers.
#
# Without MPS, kernels of two processes time-slice; with it they run side by side, each on
# its SM partition. Idempotent: a daemon already answering on the pipe directory is reused.
#
# Usage:  bash scripts/start_mps.sh                 # messages on stderr, exports on stdout
#         eval "$(bash scripts/start_mps.sh)"       # ... and make this shell's CUDA processes clients
# Env:    CUDA_MPS_PIPE_DIRECTORY  default /tmp/bullet-mps-$USER/pipe
#         CUDA_MPS_LOG_DIRECTORY   default /tmp/bullet-mps-$USER/log
# Exit:   0 daemon running (started now or already), 1 it did not start, 2 nvidia-cuda-mps-control missing.
# Stop it with scripts/kill_mps.sh (same environment).
set -u
user=${USER:-$(id -un 2>/dev/null || id -u)}
base=/tmp/bullet-mps-$user
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-$base/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-$base/log}

say() { echo "start_mps: $*" >&2; }
print_env() {
  echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY"
  echo "export CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
}
answers() {
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] &&
    echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1
}

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  say "nvidia-cuda-mps-control not found on PATH: install the NVIDIA driver's MPS utilities"
  exit 2
fi
if answers; then
  say "MPS daemon already running (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
  print_env
  exit 0
fi
if ! mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; then
  say "cannot create $CUDA_MPS_PIPE_DIRECTORY or $CUDA_MPS_LOG_DIRECTORY"
  exit 1
fi
if ! nvidia-cuda-mps-control -d; then
  # "An instance of this daemon is already running": a daemon that is still starting, or
  # one being stopped by kill_mps.sh a moment ago; give it time to answer or to go away.
  for _ in $(seq 1 50); do
    if answers; then
      say "MPS daemon already running (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
      print_env
      exit 0
    fi
    sleep 0.2
    nvidia-cuda-mps-control -d 2>/dev/null && break
  done
  if ! answers; then
    say "nvidia-cuda-mps-control -d failed; log:"
    tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" >&2 2>/dev/null
    exit 1
  fi
fi
for _ in $(seq 1 50); do
  if answers; then
    say "MPS daemon started (pipe directory $CUDA_MPS_PIPE_DIRECTORY, logs $CUDA_MPS_LOG_DIRECTORY)"
    say "CUDA processes become clients when started with CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY"
    print_env
    exit 0
  fi
  sleep 0.2
done
say "MPS daemon did not answer within 10 s; log:"
tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" >&2 2>/dev/null
exit 1
