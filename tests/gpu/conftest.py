"""GPU tests: collected on every machine, run only where CUDA is available.

Every test under tests/gpu gets the `gpu` marker (registered in tests/conftest.py), so
`pytest -m gpu tests` selects them, and is skipped without a CUDA device. The one exception
is a module that sets RUNS_IN_TRITON_INTERPRETER = True: with TRITON_INTERPRET=1 it runs on
CPU in the Triton interpreter. On a GPU machine: `bash scripts/gpu_run.sh tests`.

tests/conftest.py (the `checkpoint` fixture, the repository root on sys.path) applies here as
well, so tests/checkpoints.py, tests/triton_fixture.py and tests/gpu/numerics.py import as
`tests.<module>` / `tests.gpu.<module>`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# tryfirst: the `-m gpu` selection runs in pytest's own modifyitems hook and must see the
# marker added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on a GPU machine: bash scripts/gpu_run.sh tests)")
    for item in items:
        if HERE not in item.path.parents:
            continue  # this hook sees the whole session's items, not only this directory's
        item.add_marker(pytest.mark.gpu)
        if CUDA or (INTERPRET and getattr(getattr(item, "module", None), "RUNS_IN_TRITON_INTERPRETER", False)):
            continue
        item.add_marker(skip)


@pytest.fixture(scope="session")
def mps_daemon() -> str:
    """The pipe directory of a running MPS control daemon whose client this process is.

    The spatial modes' workers refuse to run on a partition outside MPS (two processes
    without it only time-slice). The daemon is not started here: CUDA reads
    CUDA_MPS_PIPE_DIRECTORY when this process initializes it, which earlier tests have done,
    and the engine process shares its memory with the workers, so it must be a client too.
    scripts/gpu_run.sh starts the daemon and exports the variable before pytest starts."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    control = shutil.which("nvidia-cuda-mps-control")
    answers = False
    if pipe and control:
        try:
            answers = subprocess.run([control], input="get_server_list\n", capture_output=True, timeout=10,
                                     text=True, env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe)).returncode == 0
        except subprocess.TimeoutExpired:
            pass
    if not answers:
        pytest.skip("no MPS daemon at CUDA_MPS_PIPE_DIRECTORY: run under scripts/gpu_run.sh, which starts one")
    if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        pytest.skip("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set: it caps green contexts")
    return pipe


@pytest.fixture
def green():
    """green(role, splits) -> a prepared green-context partitioner, closed after the test
    (MPS caps the contexts a client may hold)."""
    from bullet_trt.spatial.partitioners import make_partitioner

    made = []

    def make(role: str, splits: list[int] | None = None):
        try:
            part = make_partitioner("green", "cuda")
        except RuntimeError as e:  # no green contexts on this driver / device
            pytest.skip(str(e))
        made.append(part)
        part.prepare(role, splits)
        return part

    yield make
    for part in made:
        part.close()
