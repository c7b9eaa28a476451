"""The workers' GPU memory report reads the CUDA caching allocator: a step that leaves a new
segment reserved is reported, with the device's free memory."""
from __future__ import annotations

import torch

from bullet_trt.engine.memory_watch import ReservedMemoryWatch
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem


def test_reports_a_new_allocator_segment():
    gpu = torch.device("cuda")
    torch.cuda.empty_cache()  # a cached free segment from earlier tests would absorb the allocation
    watch = ReservedMemoryWatch.for_device("prefill", gpu)
    assert watch is not None and "of GPU memory at start; the device has" in watch.started()
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device=gpu)
    line = watch.after_step([BatchItem("r0", [0] * 2048, 0, [0], SamplingParams(), True)])
    assert line is not None and "grew by 512 MiB" in line and "GiB free" in line
    del held


def test_sampling_in_the_scratch_buffer_keeps_the_allocator_from_growing():
    """Without the session's float32 buffer, every new largest batch's float32 logits take a new
    allocator segment and the smaller ones stay cached (after graph capture emptied the cache,
    that is how a decode worker grew while serving); with it, the batch may grow for free."""
    from bullet_trt.engine.sampling import SamplingBatch, float32_scratch, sample

    gpu = torch.device("cuda")
    vocab = 128256
    logits = torch.randn(1024, vocab, dtype=torch.bfloat16, device=gpu)

    def growth(scratch) -> int:
        torch.cuda.synchronize(gpu)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(gpu)
        for b in (256, 384, 512, 640, 768, 896, 1024):
            batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * b, [0] * b, [[]] * b, gpu)
            sample(logits[:b], batch, scratch)
        torch.cuda.synchronize(gpu)
        return torch.cuda.memory_reserved(gpu) - before

    without = growth(None)
    scratch = float32_scratch(1024, vocab, gpu)
    with_scratch = growth(scratch)
    assert with_scratch < 16 * 2**20, with_scratch
    assert without > with_scratch + 256 * 2**20, (without, with_scratch)
