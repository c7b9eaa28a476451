"""`bench mixed-step --host-profile` counts only the host events inside the launch's window:
what the profiler records before or after it (its own synchronize when it stops, on a GPU) is
not the launch's. Checked here with torch.profiler's CPU events."""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bullet_trt.tools.bench.mixed_step import window_events


def test_only_the_windows_events_count_and_its_python_time_is_apart():
    x = torch.ones(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(x, x)  # before the window
        with record_function("launch"):
            torch.add(x, 1)
            torch.add(x, 2)
            time.sleep(0.02)  # the launch's own Python, in no op
        torch.sigmoid(x)  # after it
    found = window_events(prof.events(), "launch", top=50)
    names = {e["name"]: e for e in found["events"]}
    assert "aten::add" in names and names["aten::add"]["calls"] == 2
    assert "aten::mm" not in names and "aten::sigmoid" not in names and "launch" not in names
    assert found["outside_events_ms"] >= 20
    assert abs(found["events_ms"] - sum(e["self_ms"] for e in found["events"])) < 0.01
    assert found["events_ms"] < found["outside_events_ms"]
