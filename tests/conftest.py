"""Shared fixtures: the repo root on sys.path and one cached checkpoint per test variant."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> Path of a small random checkpoint, made once per session.

    name is a family ("llama", "mistral", "qwen2", "qwen3") or a variant of
    tests.checkpoints.VARIANTS ("llama-llama3", "qwen3-tied", "llama-sharded", ...).
    """
    from tests.checkpoints import make_variant

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_variant(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run them on a GPU machine)")
