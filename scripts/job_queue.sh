#!/usr/bin/env bash
# A queue of GPU jobs that several workers take from (scripts/gpu_lists.sh --queue):
#
#   bash scripts/job_queue.sh take QUEUE SECONDS_LEFT
#   bash scripts/job_queue.sh put QUEUE 'SECONDS COMMAND' [NOTE]
#   bash scripts/job_queue.sh pick GPU_NAME JOBS...
#   bash scripts/job_queue.sh drop QUEUE 'SECONDS COMMAND'
#   bash scripts/job_queue.sh forget QUEUE DONE
#
# QUEUE holds one job a line, `SECONDS COMMAND`: the most seconds the job may take (its
# servers' start, its runs and their drains), then a bash command line; blank lines and lines
# starting with # are skipped. `take` prints the line of the first job that fits in
# SECONDS_LEFT, removes it and exits 0, or exits 1 when none fits. `put` appends a job line
# (creating QUEUE), after NOTE as a comment line when given: a worker hands back a job whose
# runs did not all start. A lock (QUEUE.lock) makes one take or put at a time, so two workers
# never get the same job. `pick` prints the first of several jobs files that is for GPU_NAME
# (nvidia-smi's name): a file's `# gpu: NAME` line names the GPUs it is for (any whose name
# contains NAME), a file without one is for any; it exits 1 when none is, since a figure
# measured on the wrong GPU is worse than none (a machine asked for with one kind of GPU
# may come with another). `drop` removes the queued jobs that differ from the given one only
# in their SEED= (and seconds) and prints them: the protocol's other seeds of a rate that one
# seed's run has decided (bench serve's "decided whatever the protocol's other seeds attain");
# a job without SEED= has no such siblings.
set -u -o pipefail
usage() { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }
case "${1:-}" in
  take | drop | forget) [ $# -eq 3 ] || usage ;;
  put) [ $# -eq 3 ] || [ $# -eq 4 ] || usage ;;
  pick)
    [ $# -ge 3 ] || usage
    gpu_name=$2
    shift 2
    for jobs in "$@"; do
      [ -f "$jobs" ] || { echo "job_queue: no jobs file $jobs" >&2; exit 2; }
      want=$(sed -n 's/^#[[:space:]]*gpu:[[:space:]]*//p' "$jobs" | head -1 | sed 's/[[:space:]]*$//')
      if [ -z "$want" ] || [[ "$gpu_name" == *"$want"* ]]; then echo "$jobs"; exit 0; fi
    done
    echo "job_queue: none of $* is for a '$gpu_name' (their '# gpu:' lines)" >&2
    exit 1
    ;;
  *) usage ;;
esac
op=$1 queue=$2
exec 9>"$queue.lock"
flock 9
if [ "$op" = put ]; then
  [[ "$3" =~ ^[0-9]+[[:space:]]+[^[:space:]] ]] || { echo "job_queue: a job line starts with its seconds, then the command; got '$3'" >&2; exit 2; }
  { [ -n "${4:-}" ] && printf '# %s\n' "${4//$'\n'/ }"; printf '%s\n' "$3"; } >>"$queue"
  exit 0
fi
[ -f "$queue" ] || { echo "job_queue: no queue file $queue" >&2; exit 2; }
take_out() {  # take_out TEST: prints and removes the queue's job lines for which `TEST LINE` succeeds
  local keep line
  keep=$(mktemp "$queue.XXXXXX")
  while IFS= read -r line || [ -n "$line" ]; do
    if [[ ! "$line" =~ ^[[:space:]]*(#|$) ]] && "$1" "$line"; then
      printf '%s\n' "$line"
    else
      printf '%s\n' "$line" >>"$keep"
    fi
  done <"$queue"
  mv "$keep" "$queue"
}
if [ "$op" = drop ]; then
  [[ "$3" == *SEED=* ]] || exit 0
  key() { sed -E 's/^[[:space:]]*[0-9]+[[:space:]]+//; s/(^|[[:space:]])SEED=[^[:space:]]*//; s/[[:space:]]+/ /g; s/^ //; s/ $//'; }
  want=$(key <<<"$3")
  sibling() { [[ "$1" == *SEED=* ]] && [ "$(key <<<"$1")" = "$want" ]; }
  take_out sibling
  exit 0
fi
if [ "$op" = forget ]; then
  [ -f "$3" ] || exit 0
  command_of() { sed -E 's/^[[:space:]]*[0-9]+[[:space:]]+//; s/[[:space:]]+$//'; }
  declare -A ran=()
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] || ran["$(command_of <<<"$line")"]=1
  done <"$3"
  ran_before() { [ -n "${ran["$(command_of <<<"$1")"]:-}" ]; }
  take_out ran_before
  exit 0
fi
left=$3
[[ "$left" =~ ^-?[0-9]+$ ]] || { echo "job_queue: SECONDS_LEFT must be an integer, got '$left'" >&2; exit 2; }
line=$(awk -v left="$left" '
  /^[[:space:]]*(#|$)/ { next }
  {
    if ($1 !~ /^[0-9]+$/) { printf "job_queue: line %d does not start with its seconds: %s\n", NR, $0 > "/dev/stderr"; exit 3 }
    if ($1 + 0 <= left + 0) { print NR; exit }
  }' "$queue") || exit 2
[ -n "$line" ] || exit 1
sed -n "${line}p" "$queue" | sed -E 's/^[[:space:]]+//'
sed -i "${line}d" "$queue"
