#!/usr/bin/env bash
# A queue of GPU jobs that several workers take from (scripts/gpu_lists.sh --queue):
#
#   bash scripts/job_queue.sh take QUEUE SECONDS_LEFT
#
# QUEUE holds one job a line, `SECONDS COMMAND`: the most seconds the job may take (its
# servers' start, its runs and their drains), then a bash command line; blank lines and lines
# starting with # are skipped. `take` prints the command of the first job that fits in
# SECONDS_LEFT, removes its line and exits 0, or exits 1 when none fits. A lock (QUEUE.lock)
# makes one take at a time, so two workers never get the same job.
set -u -o pipefail
[ "${1:-}" = take ] && [ $# -eq 3 ] || { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
queue=$2 left=$3
[ -f "$queue" ] || { echo "job_queue: no queue file $queue" >&2; exit 2; }
[[ "$left" =~ ^-?[0-9]+$ ]] || { echo "job_queue: SECONDS_LEFT must be an integer, got '$left'" >&2; exit 2; }
exec 9>"$queue.lock"
flock 9
line=$(awk -v left="$left" '
  /^[[:space:]]*(#|$)/ { next }
  {
    if ($1 !~ /^[0-9]+$/) { printf "job_queue: line %d does not start with its seconds: %s\n", NR, $0 > "/dev/stderr"; exit 3 }
    if ($1 + 0 <= left + 0) { print NR; exit }
  }' "$queue") || exit 2
[ -n "$line" ] || exit 1
job=$(sed -n "${line}p" "$queue")
sed -i "${line}d" "$queue"
printf '%s\n' "$job" | sed -E 's/^[[:space:]]*[0-9]+[[:space:]]+//'
