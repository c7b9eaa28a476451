"""scripts/code_at.sh and gpu_run.sh's CODE_AT: a sub-command run with another commit's tree,
for an A/B of two commits on one GPU host. Run here on the CPU, in a clone with two commits
that differ, as real processes (git, tar, bash, the engine build)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_sub_command_runs_in_the_tree_of_the_commit_it_names(tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--no-local", str(REPO), str(clone))
    for script in ("code_at.sh", "gpu_run.sh"):  # the checkout's own, committed or not
        shutil.copy(REPO / "scripts" / script, clone / "scripts" / script)
    (clone / "marker.txt").write_text("before\n")
    git(clone, "add", "marker.txt", "scripts")
    git(clone, "commit", "-q", "-m", "before")
    before = git(clone, "rev-parse", "--short=7", "HEAD")
    (clone / "marker.txt").write_text("after\n")
    git(clone, "commit", "-q", "-am", "after")

    packed = subprocess.run(["bash", "scripts/code_at.sh", before], cwd=clone, capture_output=True, text=True,
                            timeout=120)
    assert packed.returncode == 0, packed.stderr
    assert packed.stdout.strip().endswith(f"CODE_AT={before}")
    names = subprocess.run(["tar", "tzf", str(clone / ".whl" / f"code_{before}.tar.gz")], capture_output=True,
                           text=True, check=True).stdout.split()
    assert "marker.txt" in names and "scripts/gpu_run.sh" in names
    assert not any(n.startswith("docs/data/gpu_round_2026-11-26h/h100") for n in names)  # the rounds' GPU data stay out

    work = tmp_path / "work"
    show = 'echo "$PWD|$OUT|$ENGINE"; cat marker.txt; test -f "$ENGINE/engine.yaml" && echo built'
    env = {**os.environ, "GPU_RUN_DIR": str(work), "NO_MPS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    ran = {}
    for code_at in (before, ""):
        done = subprocess.run(["bash", "scripts/gpu_run.sh", "run", "sh", "-c", show], cwd=clone,
                              env={**env, "CODE_AT": code_at}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        ran[code_at] = done.stdout.split()
    where, marker, built = ran[before]
    assert where == f"{work}/code_{before}|{tmp_path}/out/code_{before}|{work}/engines/llama-3.1-8b-code_{before}"
    assert (marker, built) == ("before", "built")
    assert ran[""] == [f"{clone}|{tmp_path}/out|{work}/engines/llama-3.1-8b", "after", "built"]


def test_code_at_without_a_run_directory_or_its_tarball_says_what_to_do(tmp_path):
    env = {**os.environ, "NO_MPS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "CODE_AT": "0000000"}
    env.pop("GPU_RUN_DIR", None)
    alone = subprocess.run(["bash", "scripts/gpu_run.sh", "run", "true"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode != 0 and "CODE_AT needs GPU_RUN_DIR" in alone.stderr
    missing = subprocess.run(["bash", "scripts/gpu_run.sh", "run", "true"], cwd=REPO,
                             env={**env, "GPU_RUN_DIR": str(tmp_path / "work")}, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode != 0 and "bash scripts/code_at.sh 0000000" in missing.stderr
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
