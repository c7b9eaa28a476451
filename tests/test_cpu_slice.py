"""scripts/cpu_slice.py cuts the host's CPUs among the workers of scripts/gpu_lists.sh, which
pins each worker's subshell, and so everything it starts, to its slice."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
_spec = importlib.util.spec_from_file_location("cpu_slice", SCRIPTS / "cpu_slice.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
cpu_slice = _module.cpu_slice


def _cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as its CPUs."""
    cpus = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def test_slices_are_equal_disjoint_and_in_order():
    cpus = [5, 1, 0, 7, 3, 2, 6, 4]
    assert cpu_slice(cpus, 2, 0) == [0, 1, 2, 3]
    assert cpu_slice(cpus, 2, 1) == [4, 5, 6, 7]
    thirds = [cpu_slice(cpus, 3, i) for i in range(3)]
    assert [len(s) for s in thirds] == [2, 2, 2]
    assert sorted(c for s in thirds for c in s) == [0, 1, 2, 3, 4, 5]  # 6 and 7 left to nobody
    assert cpu_slice([0, 1], 4, 3) == []  # fewer CPUs than workers: no pinning
    with pytest.raises(ValueError, match="index 2 is not one of 2 workers"):
        cpu_slice(cpus, 2, 2)


def test_the_script_prints_its_slice_of_this_process_cpus():
    allowed = sorted(os.sched_getaffinity(0))
    whole = subprocess.run([sys.executable, str(SCRIPTS / "cpu_slice.py"), "1", "0"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert [int(c) for c in whole.split(",")] == allowed
    usage = subprocess.run([sys.executable, str(SCRIPTS / "cpu_slice.py")], capture_output=True, text=True)
    assert usage.returncode == 2 and "WORKERS INDEX" in usage.stderr


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_a_worker_subshell_pinned_as_gpu_lists_pins_it_runs_its_commands_on_its_slice():
    allowed = sorted(os.sched_getaffinity(0))
    workers = min(2, len(allowed))
    for index in range(workers):
        cpus = subprocess.run([sys.executable, str(SCRIPTS / "cpu_slice.py"), str(workers), str(index)],
                              capture_output=True, text=True, check=True).stdout.strip()
        # gpu_lists.sh's worker: the subshell pins itself, and the commands it starts inherit it
        shell = f'( taskset -pc "{cpus}" "$BASHPID" >/dev/null && grep Cpus_allowed_list /proc/self/status )'
        seen = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True).stdout
        child = _cpu_list(re.search(r"Cpus_allowed_list:\s*(\S+)", seen).group(1))
        assert child == cpu_slice(allowed, workers, index)
    script = (SCRIPTS / "gpu_lists.sh").read_text()
    assert 'taskset -pc "$cpus" "$BASHPID"' in script and "scripts/cpu_slice.py" in script
