# Sourced by a GPU round's report.sh (docs/data/gpu_round_*/report.sh), from the repository
# root with $R set to the round's GPU folder:
#   report NAME TPOT_MS PATH...
# writes one `bench serve --compare` over the paths (directories or result files, TTFT <= 1 s)
# into $R/NAME: summary.md and the attainment plots, without the latency CDFs (one per rate:
# many files, little to read).
report() {
  local name=$1 tpot=$2
  shift 2
  bullet-trt bench serve --compare "$@" --ttft-slo-ms 1000 --tpot-slo-ms "$tpot" --report-dir "$R/$name"
  rm -f "$R/$name"/latency_cdf_*.png
}
