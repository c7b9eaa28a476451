#!/usr/bin/env bash
# Runs GPU work on a GPU machine without registry access, from the repository root.
#
#   bash scripts/gpu_run.sh tests [--cpu] [PYTEST ARGS...]
#       pytest -m gpu tests: every GPU test (tests/gpu/, and the gpu-marked tests elsewhere,
#       e.g. tests/test_sm.py); --cpu also runs the CPU suite (pytest -m "not gpu" tests).
#       Test paths among the arguments replace `tests`: `tests tests/gpu/test_gpu.py -x`.
#   bash scripts/gpu_run.sh bench KIND [ARGS...]
#       bullet-trt bench KIND ARGS. Without --engine-dir, `kernels`, `decode-profile`, `decode-overlap`, `tp`,
#       `mixed-step` and `serve --start-server` get a dummy-weight Llama-3.1-8B engine ($ENGINE, built here),
#       `moe` a dummy-weight Qwen3-30B-A3B one ($MOE_ENGINE; 61 GB of weights, so an H200
#       leaves room for more KV than an H100); `kernels`, `decode-profile`, `moe`, `tp` and `mixed-step` write
#       --json $OUT/bench_KIND.json unless given one. `tp` (a machine of 2+ GPUs): the
#       all-reduce and the decode step at --tp N against one GPU.
#   bash scripts/gpu_run.sh serve-compare [bench serve ARGS...]
#       the serving comparison: tritonserver started once per mode ($MODES, default
#       chunked,bullet,static) on the dummy Llama-3.1-8B, an open-loop Poisson sweep over gRPC
#       streaming per mode, then the table and plots (bullet-trt bench serve --start-server).
#       Env: RATES (12,18,24,30), DATASET (sharegpt), LOAD ("--duration 12"),
#       TTFT_SLO / TPOT_SLO (ms, 1000 / 50), STATIC_SMS (64), EXTRA (more bench serve args),
#       CALIBRATE ("--set k=v ...": calibrate the engine first with the decode profile the
#       server runs, and keep perf_model.<gpu>.yaml / perf_profile.<gpu>.json in $OUT;
#       otherwise the H200 and H100 calibrations in docs/data are used on those GPUs, and
#       another GPU is calibrated by the first server that starts on it, serve.calibrate=auto).
#   bash scripts/gpu_run.sh run CMD [ARGS...]
#       any command in the same environment, with `python` the interpreter set up here and
#       OUT and ENGINE (the dummy Llama-3.1-8B, built) exported, e.g.
#         run python -m bullet_trt.tools.doctor --strict --json out/sm_doctor.json
#         run sh -c 'python build_engines.py --profile --out "$ENGINE" && cp "$ENGINE"/perf_* "$OUT"'
#
# What it sets up first:
#   - Python: .whl/ (made by scripts/gpu_assets.sh where PyPI is reachable) holds tritonserver
#     (triton_min.tar.xz), tritonclient (tritonclient_py.tar.gz), numpy 1.26 and rapidjson
#     (py_deps.tar.xz) and any other wheels. They go into the site-packages of a venv in a temporary directory, which sees
#     $PYTHON's packages (torch, triton, transformers) through a .pth file behind them:
#     tritonserver 2.51's Python-backend stub misreads BYTES inputs under numpy 2, and the
#     stub runs the interpreter that starts the server. A $PYTHON that already has them (the
#     .venv of scripts/setup.sh) runs as it is.
#   - NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast is off on
#     the shared machines; harmless on one GPU).
#   - a private MPS daemon (scripts/start_mps.sh), stopped on exit if this script started it:
#     the spatial modes' workers only share the GPU as MPS clients.
#
# Env: OUT           output directory (default ./out): logs, JSON, JUnit XML
#      PYTHON        interpreter with torch/triton (default .venv/bin/python if present, else python3)
#      GPU_RUN_DIR   where the carried wheels go (default: a new directory under ${TMPDIR:-/tmp},
#                    removed on exit; a given one is kept and reused)
#      ENGINE        the dummy-weight engine for bench / serve-compare (default $GPU_RUN_DIR/engines/llama-3.1-8b)
#      MOE_ENGINE    the dummy-weight MoE engine for bench moe (default $GPU_RUN_DIR/engines/qwen3-30b-a3b)
#      NO_MPS=1      do not start the MPS daemon
#      CODE_AT       a commit whose code runs the sub-command instead of this tree's (an A/B on one
#                    host; below), from .whl/code_COMMIT.tar.gz made by scripts/code_at.sh
set -u -o pipefail

out=${OUT:-./out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

say() { echo "gpu_run: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
usage() { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2; }

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in tests|bench|serve-compare|run) ;; -h|--help|help) usage ;; *) say "unknown sub-command $cmd"; usage ;; esac

if [ -n "${GPU_RUN_DIR:-}" ]; then
  work=$GPU_RUN_DIR
  mkdir -p "$work" || die "cannot create GPU_RUN_DIR=$work"
  own_work=
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/bullet-gpu-run.XXXXXX") || die "mktemp failed"
  own_work=1
fi

# -- another commit's code --------------------------------------------------------------------
# Hosts of one GPU kind differ (2026-11-26, eighth round: the same code attained 50.0% on one
# host and 82.4% on another), so a change is measured against the code before it on one machine.
# CODE_AT=COMMIT runs the whole sub-command with that commit's tree instead of this one: its
# .whl/code_COMMIT.tar.gz (made by scripts/code_at.sh) unpacked once into $GPU_RUN_DIR, with
# engines of its own build ($GPU_RUN_DIR/engines/*-code_COMMIT: an engine directory names its
# settings, which another commit may not know) and its outputs in $OUT/code_COMMIT.
if [ -n "${CODE_AT:-}" ]; then
  [ -z "$own_work" ] || die "CODE_AT needs GPU_RUN_DIR (its tree and engines outlive one call)"
  tarball=$ROOT/.whl/code_$CODE_AT.tar.gz
  [ -f "$tarball" ] || die "CODE_AT=$CODE_AT: no $tarball (make it here with: bash scripts/code_at.sh $CODE_AT)"
  tree=$work/code_$CODE_AT
  if [ ! -f "$tree/.unpacked" ]; then
    rm -rf "$tree" && mkdir -p "$tree" && tar xzf "$tarball" -C "$tree" || die "cannot unpack $tarball"
    ln -s "$ROOT/.whl" "$tree/.whl"
    touch "$tree/.unpacked"
  fi
  say "running the code of $CODE_AT ($tree)"
  exec env -u CODE_AT OUT="$out/code_$CODE_AT" ENGINE="$work/engines/llama-3.1-8b-code_$CODE_AT" \
    MOE_ENGINE="$work/engines/qwen3-30b-a3b-code_$CODE_AT" bash "$tree/scripts/gpu_run.sh" "$cmd" "$@"
fi

ENGINE=${ENGINE:-$work/engines/llama-3.1-8b}
MOE_ENGINE=${MOE_ENGINE:-$work/engines/qwen3-30b-a3b}
mps_started=

cleanup() {
  local rc=$?
  if [ -n "$mps_started" ]; then
    KILL_MPS_TIMEOUT=10 timeout 15 bash scripts/kill_mps.sh >/dev/null 2>&1 || say "the MPS daemon did not stop"
  fi
  [ -n "$own_work" ] && rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- Python -----------------------------------------------------------------------------------
base=${PYTHON:-}
if [ -z "$base" ]; then
  if [ -x .venv/bin/python ]; then base=$ROOT/.venv/bin/python; else base=python3; fi
fi
command -v "$base" >/dev/null || die "$base not found (set PYTHON)"
fits='import importlib.util as u, numpy; assert u.find_spec("pytriton") and numpy.__version__ < "2"'
if "$base" -c "$fits" 2>/dev/null; then
  PY=$(command -v "$base")  # e.g. the .venv of scripts/setup.sh: nothing to install
elif [ -f .whl/triton_min.tar.xz ]; then
  venv=$work/venv
  [ -x "$venv/bin/python" ] || "$base" -m venv --without-pip "$venv" || die "cannot make a venv with $base"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ ! -f "$site/.bullet_carried_wheels" ]; then
    say "installing the carried wheels of .whl/ into $site"
    tar xJf .whl/triton_min.tar.xz -C "$site" || die "cannot unpack .whl/triton_min.tar.xz"
    if [ -f .whl/tritonclient_py.tar.gz ]; then
      tar xzf .whl/tritonclient_py.tar.gz -C "$site" || die "cannot unpack .whl/tritonclient_py.tar.gz"
    fi
    if [ -f .whl/py_deps.tar.xz ]; then
      tar xJf .whl/py_deps.tar.xz -C "$site" || die "cannot unpack .whl/py_deps.tar.xz"
    fi
    wheels=(.whl/*.whl)
    if [ -e "${wheels[0]}" ]; then
      PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$base" -m pip install -q --no-index --no-deps --target "$site" "${wheels[@]}" \
        || die "cannot install ${wheels[*]}"
    fi
    # behind this venv's own site-packages, so that numpy 1.26 wins over the machine's
    "$base" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz_machine_packages.pth"
    touch "$site/.bullet_carried_wheels"
  fi
  PY=$venv/bin/python
else
  say "no .whl/triton_min.tar.xz and no tritonserver with numpy < 2 in $base: the server tests will fail"
  PY=$(command -v "$base")
fi
BASE_PY=$(command -v "$base")
# `python` for `run`: a wrapper, not a symlink, since a venv's interpreter finds its
# pyvenv.cfg next to the path it was started by
mkdir -p "$work/bin"
for name in python python3; do
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" >"$work/bin/$name"
  chmod +x "$work/bin/$name"
done
export PATH="$work/bin:$PATH"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  # it would cap the green contexts

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>&1
  else
    echo "no nvidia-smi"
  fi
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
  "$PY" -c 'import numpy; print("numpy", numpy.__version__)' 2>&1
  # the engine loop and the workers' step preparation are Python: the host's cores set part of
  # a serving run's pace, and runs on different hosts differed at the same GPU clocks (2026-11-26)
  echo "host: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores," \
    "python pace $("$PY" -c 'from bullet_trt.tools.bench.host import python_pace_ns as p; print(f"{p():.1f}")' 2>&1) ns/item"
} | tee "$out/environment.txt" >&2

# -- MPS --------------------------------------------------------------------------------------
if [ "${NO_MPS:-0}" != 1 ]; then
  if mps_env=$(timeout 30 bash scripts/start_mps.sh 2>"$work/start_mps.log"); then
    eval "$mps_env"
    grep -q "MPS daemon started" "$work/start_mps.log" && mps_started=1
    say "MPS daemon at $CUDA_MPS_PIPE_DIRECTORY"
  else
    say "no MPS daemon ($(tail -1 "$work/start_mps.log")): tests that need one are skipped"
  fi
fi

ensure_engine() {  # ensure_engine [DIR ARCH]: a dummy-weight engine (default: $ENGINE, Llama-3.1-8B)
  local dir=${1:-$ENGINE} arch=${2:-llama-3.1-8b}
  [ -f "$dir/engine.yaml" ] && return 0
  say "building the dummy-weight $arch engine in $dir"
  "$PY" build_engines.py --dummy-weights --arch "$arch" --out "$dir" --max-model-len 4096 >/dev/null \
    || die "build_engines.py failed"
}

has_arg() {  # has_arg FLAG ARGS...: whether FLAG (or FLAG=...) is among ARGS
  local flag=$1 a
  shift
  for a in "$@"; do
    case "$a" in "$flag"|"$flag"=*) return 0 ;; esac
  done
  return 1
}

# -- sub-commands -----------------------------------------------------------------------------
case "$cmd" in
  tests)
    cpu=
    if [ "${1:-}" = --cpu ]; then cpu=1; shift; fi
    if command -v make >/dev/null; then  # the SM-id probe of tests/test_sm.py; skipped without nvcc
      timeout 60 make -C native >"$out/native_build.log" 2>&1 || say "make -C native failed (see $out/native_build.log)"
    fi
    where=(tests)  # unless test paths (or node ids) are among the arguments
    for a in "$@"; do [ -e "${a%%::*}" ] && where=(); done
    # Tests that start tritonserver (files named *triton_server*) run under $PY, whose numpy
    # 1.26 the 2.51 stub needs; the others under the machine's own interpreter, whose
    # transformers and scipy need numpy 2. A module that does not import must not cost the
    # GPU run: it is reported, not fatal.
    gpu_pytest() {  # gpu_pytest PYTHON NAME ARGS...
      local py=$1 name=$2
      shift 2
      "$py" -m pytest -p no:cacheprovider -q -rfEs -m gpu --continue-on-collection-errors \
        --junitxml="$out/$name.xml" "$@" 2>&1 | tee "$out/$name.log"
    }
    if [ ${#where[@]} -eq 0 ]; then  # the paths given: one run, by what they hold
      case " $* " in *triton_server*) gpu_pytest "$PY" gpu_tests "$@" ;; *) gpu_pytest "$BASE_PY" gpu_tests "$@" ;; esac
      rc=$?
    else
      gpu_pytest "$BASE_PY" gpu_tests --ignore-glob='*triton_server*' tests "$@"
      rc=$?
      gpu_pytest "$PY" gpu_server_tests tests/gpu/test_triton_server_gpu.py "$@"
      server_rc=$?
      [ $rc -eq 0 ] && rc=$server_rc
    fi
    if [ -n "$cpu" ]; then
      "$PY" -m pytest -p no:cacheprovider -q -rfE -m "not gpu" --junitxml="$out/cpu_tests.xml" \
        "${where[@]}" "$@" 2>&1 | tee "$out/cpu_tests.log"
      cpu_rc=$?
      [ $rc -eq 0 ] && rc=$cpu_rc
    fi
    exit $rc
    ;;
  bench)
    [ $# -ge 1 ] || die "bench needs a kind: kernels, decode-profile, serve, ..."
    kind=$1
    shift
    args=("$@")
    needs_engine=
    case "$kind" in
      kernels|decode-profile|decode-overlap|steps-ahead|tp|mixed-step) needs_engine=1 ;;
      serve) has_arg --start-server "${args[@]}" && needs_engine=1 ;;
    esac
    if [ -n "$needs_engine" ] && ! has_arg --engine-dir "${args[@]}"; then
      ensure_engine
      args+=(--engine-dir "$ENGINE")
    fi
    if [ "$kind" = moe ] && ! has_arg --engine-dir "${args[@]}"; then
      ensure_engine "$MOE_ENGINE" qwen3-30b-a3b
      args+=(--engine-dir "$MOE_ENGINE")
    fi
    case "$kind" in
      kernels|decode-profile|decode-overlap|steps-ahead|moe|tp|mixed-step) has_arg --json "${args[@]}" || args+=(--json "$out/bench_$kind.json") ;;
    esac
    "$PY" -m bullet_trt.tools.cli bench "$kind" "${args[@]}" 2>&1 | tee "$out/bench_$kind.log"
    exit $?
    ;;
  serve-compare)
    ensure_engine
    if [ -n "${CALIBRATE:-}" ]; then
      # shellcheck disable=SC2086 # CALIBRATE is a list of --set arguments
      "$PY" build_engines.py --profile --out "$ENGINE" $CALIBRATE 2>&1 | tail -3 || die "calibration failed"
      cp "$ENGINE"/perf_model.*.yaml "$ENGINE"/perf_profile.*.json "$out/"
    else
      bash scripts/stored_calibrations.sh "$ENGINE"
    fi
    rm -rf "$out/serve"
    # shellcheck disable=SC2086 # LOAD and EXTRA are lists of arguments
    "$PY" -m bullet_trt.tools.cli bench serve --start-server --engine-dir "$ENGINE" \
      --modes "${MODES:-chunked,bullet,static}" --set "serve.static_prefill_sms=${STATIC_SMS:-64}" \
      --dataset "${DATASET:-sharegpt}" --rates "${RATES:-12,18,24,30}" ${LOAD:---duration 12} \
      --ttft-slo-ms "${TTFT_SLO:-1000}" --tpot-slo-ms "${TPOT_SLO:-50}" --out "$out/serve" --no-progress \
      ${EXTRA:-} "$@" 2>&1 | tee "$out/serve_compare.log" | tail -60
    rc=$?
    cat "$out/serve/summary.md" 2>/dev/null
    # one archive: the per-request records are many small files
    [ -d "$out/serve" ] && tar czf "$out/serve_results.tar.gz" -C "$out" serve && rm -rf "$out/serve"
    exit $rc
    ;;
  run)
    [ $# -ge 1 ] || die "run needs a command"
    ensure_engine
    export OUT=$out ENGINE
    "$@"
    exit $?
    ;;
esac
