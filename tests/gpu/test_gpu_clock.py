"""The GPU step clock (bullet_trt/engine/step_clock.py) that `bench overlap` reads: stamps of
the device's %globaltimer queued on a stream around a step.

What the overlap figure relies on, asserted as order, never as a duration: the two stamps
bracket the work queued between them, and two processes read one timer (a stamp taken after
another process's stamp was seen is not earlier), so a prefill worker's and a decode worker's
windows can be compared.
"""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from bullet_trt.engine.step_clock import GpuStepClock


def _stamp_in_a_child(out) -> None:
    clock = GpuStepClock(torch.device("cuda"))
    clock.begin()
    clock.finish()
    torch.cuda.synchronize()
    out.put(clock.window_ns())


def test_the_stamps_bracket_the_work_queued_between_them():
    device = torch.device("cuda")
    clock = GpuStepClock(device)
    stream = torch.cuda.Stream(device)
    windows = []
    with torch.cuda.stream(stream):
        for _ in range(3):
            clock.begin()
            torch.cuda._sleep(20_000_000)  # ~10 ms of spinning at any clock: far above the timer's step
            clock.finish()
            stream.synchronize()
            windows.append(clock.window_ns())
    for start, end in windows:
        assert 0 < start < end, windows
    # steps on one stream, one after the other: each window starts after the previous ended
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start >= end, windows


def test_two_processes_read_one_timer():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    clock = GpuStepClock(torch.device("cuda"))
    clock.begin()
    clock.finish()
    torch.cuda.synchronize()
    _, before_child = clock.window_ns()
    child = ctx.Process(target=_stamp_in_a_child, args=(out,))
    child.start()
    child_start, child_end = out.get(timeout=300)
    child.join(timeout=60)
    clock.begin()
    clock.finish()
    torch.cuda.synchronize()
    after_child, _ = clock.window_ns()
    assert before_child <= child_start <= child_end <= after_child, (before_child, child_start, child_end,
                                                                     after_child)
