#!/usr/bin/env bash
# Start tritonserver with model_repository/bullet (what `bullet-trt serve` does).
#   bash scripts/serve.sh                                   # embedded default engine, ports 8000-8002
#   bash scripts/serve.sh --engine-dir engines/llama8b --set serve.mode=chunked
#   bash scripts/serve.sh --dry-run                         # print the environment and command only
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] || { echo "serve: .venv missing: run bash scripts/setup.sh first" >&2; exit 1; }
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m bullet_trt.tools.cli serve "$@"
