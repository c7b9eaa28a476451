"""`--json PATH` of the measuring benches (kernels, moe, mixed-step, decode-profile, tp): the
result as one indented JSON file, which docs/data keeps next to the figures quoted from it."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
