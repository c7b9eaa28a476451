"""A digest of the code whose speed a calibration measures.

A calibration's figures hold for the kernels and the forward pass that ran while it was
measured. The twenty-ninth round's kernels (the experts' sum in one pass, the activations'
rounding vectorized, the router in one kernel) made Qwen3-30B-A3B's w8a8 decode step 1.14x
faster without touching a tile table, so the stored calibration kept its tiles' fingerprint and
went on being served, predicting that step 1.14x slow at serving's rows: bullet, planning from it,
failed 68 req/s on TTFT (93.2%, last third 80.1%), and held it on a calibration measured on the
new kernels (100.0%, another machine of the same GPU; docs/benchmarks.md, thirtieth round). A
calibration therefore records this digest, and a server whose digest differs measures again at
start (serve.calibrate=auto).

The digest covers the GPU kernels (bullet_trt/kernels), the forward pass that calls them
(model/transformer.py) and how steps replay (engine/cuda_graphs.py, engine/piecewise_graphs.py),
each file as Python parses it without its docstrings, so that an edit to a comment or a
docstring leaves calibrations standing and an edit to code does not. The MoE tile tables are
data, fingerprinted on their own (calibration_store.moe_tiles_of).
"""
from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
STEP_CODE_FILES = ("kernels/*.py", "model/transformer.py", "engine/cuda_graphs.py", "engine/piecewise_graphs.py")


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(files: list[Path], root: Path) -> str:
    """12 hex digits over the files' code (their paths relative to ``root`` included, so that a
    moved kernel counts as a change)."""
    digest = hashlib.sha256()
    for path in sorted(files):
        tree = _without_docstrings(ast.parse(path.read_text(), filename=str(path)))
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(ast.dump(tree, include_attributes=False).encode() + b"\0")
    return digest.hexdigest()[:12]


@functools.cache
def step_code() -> str:
    """The digest of this installation's step code (computed once a process)."""
    files = sorted({p for pattern in STEP_CODE_FILES for p in PACKAGE.glob(pattern)})
    return code_digest(files, PACKAGE)
