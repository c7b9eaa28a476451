#!/usr/bin/env bash
# Makes the .whl/ folder that scripts/gpu_run.sh installs on a GPU machine
# without registry access, from a machine that reaches PyPI:
#   triton_min.tar.xz       the nvidia-pytriton wheel's tritonserver, Python backend, the stub for
#                           $PY_VERSION and its bundled libraries (the other stubs and the
#                           libpython only the 3.13 stub links are left out to keep it small)
#   tritonclient_py.tar.gz  tritonclient's Python package, without perf_analyzer
#   py_deps.tar.xz          numpy 1.26 and python-rapidjson for $PY_VERSION, unpacked (the 2.51
#                           stub misreads BYTES under numpy 2)
# Usage: bash scripts/gpu_assets.sh            (PY_VERSION=3.12, the GPU machines' Python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
dest=$PWD/.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$work" \
  nvidia-pytriton==0.7.0 tritonclient==2.51.0 numpy==1.26.4 python-rapidjson
mkdir "$work/pt" "$work/tc"
(cd "$work/pt" && python3 -m zipfile -e "$work"/nvidia_pytriton-*.whl . \
  && find pytriton/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 ! -name "$PY_VERSION" -exec rm -r {} + \
  && rm -f nvidia_pytriton.libs/libpython3-*.13.so* \
  && chmod +x pytriton/tritonserver/bin/tritonserver pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub \
  && XZ_OPT=-6 tar cJf "$dest/triton_min.tar.xz" pytriton nvidia_pytriton.libs)
(cd "$work/tc" && python3 -m zipfile -e "$work"/tritonclient-*.whl . \
  && cd tritonclient-*.data/purelib \
  && tar czf "$dest/tritonclient_py.tar.gz" --exclude=tritonclient/bin --exclude=tritonclient/lib tritonclient)
# unpacked and xz-compressed: half the size of the two wheels, so that the tree and the assets
# fit one transfer to the GPU machine
mkdir "$work/deps"
(cd "$work/deps" && python3 -m zipfile -e "$work"/numpy-1.26*.whl . \
  && python3 -m zipfile -e "$work"/python_rapidjson-*.whl . \
  && XZ_OPT=-9 tar cJf "$dest/py_deps.tar.xz" *)
grep -qx '/.whl/' .gitignore || echo "warning: .whl/ is not ignored by .gitignore" >&2
du -ch "$dest"/* | tail -1
