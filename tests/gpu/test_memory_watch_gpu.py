"""The workers' GPU memory report reads the CUDA caching allocator: a step that leaves a new
segment reserved is reported, with the device's free memory."""
from __future__ import annotations

import torch

from bullet_trt.engine.memory_watch import ReservedMemoryWatch


def test_reports_a_new_allocator_segment():
    gpu = torch.device("cuda")
    torch.cuda.empty_cache()  # a cached free segment from earlier tests would absorb the allocation
    watch = ReservedMemoryWatch.for_device("prefill", gpu)
    assert watch is not None and "of GPU memory at start; the device has" in watch.started()
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device=gpu)
    line = watch.after_step([2048])
    assert line is not None and "grew by 512 MiB" in line and "GiB free" in line
    del held
