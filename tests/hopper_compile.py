"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU, in a process of its own:
the interpreter, once set for the test process (scripts/test.sh), replaces every kernel there, and
it runs code that Triton's compiler may refuse."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_script_output(script: str, timeout: float = 900) -> str:
    """The stdout of ``script`` (Python that calls triton.compile) run without the interpreter;
    an AssertionError with its stderr's tail when it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
