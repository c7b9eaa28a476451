#!/usr/bin/env bash
# Run the test suite with the project's environment (create it first with scripts/setup.sh).
#   bash scripts/test.sh                         # everything that runs on this machine
#   bash scripts/test.sh tests/test_triton_server.py -x
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ -x .venv/bin/python ] || { echo "test: .venv missing: run bash scripts/setup.sh first" >&2; exit 1; }
# perf_analyzer (tests/test_triton_server.py) links libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel
cudart=$(.venv/bin/python -c 'import importlib.util as u, pathlib; s=u.find_spec("nvidia.cuda_runtime"); print(pathlib.Path(list(s.submodule_search_locations)[0], "lib") if s else "")')
export LD_LIBRARY_PATH="${cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Without a GPU the Triton kernels still run: in Triton's interpreter, on CPU (tests/gpu/conftest.py)
if [ "$(.venv/bin/python -c 'import importlib.util as u, torch; print(torch.cuda.is_available() or u.find_spec("triton") is None)')" = False ]; then
  export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
fi
if [ $# -eq 0 ]; then
  # The layer contracts (pyproject.toml): no import from a lower layer up, no import circles.
  .venv/bin/lint-imports --no-cache
  set -- tests
fi
# -rx: an expected failure says which test it was and why (tritonserver 2.51's own crashes,
# which the tests that meet them mark as such) in every run's log
exec .venv/bin/python -m pytest -q -rx "$@"
