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
each file's text without its comments, docstrings, blank lines and trailing spaces, so that
an edit to a comment or a docstring leaves calibrations standing and an edit to code does not.
The text, not the parse: ``ast.dump`` differs between Python versions (3.12 added fields), and a
digest taken under 3.11 did not match a GPU machine's 3.12 for the same files. The MoE tile
tables are data, fingerprinted on their own (calibration_store.moe_tiles_of).

The digest is conservative: it changes with code a calibration never ran (the FP8 cache's path,
for one timed over a bf16 cache). A commit that changes only such code may carry a stored
calibration forward, restamped, where the kernels the calibration ran compile for its GPU to the
same code as before; the commit says so.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
STEP_CODE_FILES = ("kernels/*.py", "model/transformer.py", "engine/cuda_graphs.py", "engine/piecewise_graphs.py")


def _docstring_spans(tree: ast.AST, lines: list[str]) -> list[tuple[int, int, int, int]]:
    def column(row: int, byte_offset: int) -> int:  # ast counts UTF-8 bytes, str slicing characters
        return len(lines[row - 1].encode()[:byte_offset].decode(errors="ignore"))

    spans = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc = body[0]
            spans.append((doc.lineno, column(doc.lineno, doc.col_offset),
                          doc.end_lineno, column(doc.end_lineno, doc.end_col_offset)))
    return spans


def code_text(source: str) -> str:
    """``source`` without its comments and docstrings, each line's trailing spaces and the blank
    lines that leaves (the positions come from tokenize and ast, whose positions, unlike their
    trees, Python keeps from version to version)."""
    lines = source.splitlines()
    spans = _docstring_spans(ast.parse(source), lines)
    spans += [(*tok.start, *tok.end) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    # cut from the end, so that earlier positions stay valid (lines 1-based, columns 0-based)
    for row, col, end_row, end_col in sorted(spans, reverse=True):
        head, tail = lines[row - 1][:col], lines[end_row - 1][end_col:]
        lines[row - 1:end_row] = [head + tail]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def code_digest(files: list[Path], root: Path) -> str:
    """12 hex digits over the files' code (their paths relative to ``root`` included, so that a
    moved kernel counts as a change)."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(code_text(path.read_text()).encode() + b"\0")
    return digest.hexdigest()[:12]


@functools.cache
def step_code() -> str:
    """The digest of this installation's step code (computed once a process)."""
    files = sorted({p for pattern in STEP_CODE_FILES for p in PACKAGE.glob(pattern)})
    return code_digest(files, PACKAGE)
