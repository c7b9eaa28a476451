"""The serving loops' stall report: off unless asked for, and one line per slow iteration."""
from __future__ import annotations

import time

from bullet_trt.engine.stall_watch import StallWatch


def test_off_unless_the_environment_sets_a_threshold(monkeypatch):
    monkeypatch.delenv("BULLET_TRT_STALL_MS", raising=False)
    assert StallWatch.from_env("loop") is None
    monkeypatch.setenv("BULLET_TRT_STALL_MS", "not a number")
    assert StallWatch.from_env("loop") is None
    monkeypatch.setenv("BULLET_TRT_STALL_MS", "0")
    assert StallWatch.from_env("loop") is None
    monkeypatch.setenv("BULLET_TRT_STALL_MS", "inf")
    assert StallWatch.from_env("loop") is None


def test_reports_only_iterations_over_the_threshold(monkeypatch, capsys):
    monkeypatch.setenv("BULLET_TRT_STALL_MS", "200")
    watch = StallWatch.from_env("engine loop")
    assert watch is not None and watch.threshold_ms == 200
    watch.begin()
    watch.end(step_ms=0.5)
    assert "[stall]" not in capsys.readouterr().err
    watch.begin()
    time.sleep(0.25)
    watch.end(step_ms=250.0, running=7)
    err = capsys.readouterr().err
    assert "[stall] engine loop" in err and "step_ms=250.0" in err and "running=7" in err


def test_close_disarms_the_watch(monkeypatch):
    import gc
    monkeypatch.setenv("BULLET_TRT_STALL_MS", "200")
    watch = StallWatch.from_env("engine loop")
    watch.begin()
    assert watch._on_gc in gc.callbacks
    watch.close()
    assert watch._on_gc not in gc.callbacks
