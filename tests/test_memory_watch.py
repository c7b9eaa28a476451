"""The workers' GPU memory report: a line at start, then one per growth of at least a step."""
from __future__ import annotations

import torch

from bullet_trt.engine.memory_watch import MIB, ReservedMemoryWatch
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem


def step(token_counts: list[int]) -> list[BatchItem]:
    """A step's items with these numbers of new tokens."""
    return [BatchItem(f"r{i}", [0] * n, 0, [0], SamplingParams(), True) for i, n in enumerate(token_counts)]


class HeldTensors:
    """Memory a step leaves behind, counted the way an allocator's reserve is: what is held."""

    def __init__(self):
        self.held: list[torch.Tensor] = []

    def grow(self, mib: int) -> None:
        self.held.append(torch.empty(mib * MIB, dtype=torch.uint8))

    def reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held)


def test_reports_growth_from_the_figure_at_start(capsys):
    memory = HeldTensors()
    memory.grow(64)
    watch = ReservedMemoryWatch("decode", memory.reserved, step_mib=16)
    assert "decode worker holds 0.06 GiB of GPU memory at start" in watch.started()
    memory.grow(8)
    assert watch.after_step(step([1] * 300)) is None  # 8 MiB: under the step
    memory.grow(10)
    line = watch.after_step(step([1] * 500), step([700, 324]))  # a decode step: rows, then prompts
    assert line == ("bullet-trt: the decode worker's GPU memory grew by 18 MiB to 0.08 GiB "
                    "on a step of 502 sequences and 1524 tokens")
    assert line in capsys.readouterr().err
    # the next report counts from the figure just reported, not from the start
    memory.grow(15)
    assert watch.after_step(step([2048])) is None
    memory.grow(1)
    assert "grew by 16 MiB" in watch.after_step(step([2048]))


def test_names_the_device_free_memory_when_given():
    memory = HeldTensors()
    watch = ReservedMemoryWatch("prefill", memory.reserved, free=lambda: 3 * 2**30, step_mib=1)
    memory.grow(1)
    assert watch.after_step(step([2048])).endswith("tokens; the device has 3.00 GiB free")


def test_nothing_to_watch_on_cpu():
    assert ReservedMemoryWatch.for_device("decode", torch.device("cpu")) is None



def test_with_an_idle_cache_the_watch_reports_what_the_release_left():
    """One read of the allocator's books a step: the release goes first, and cache it handed
    back is no growth; what the step keeps allocated is."""
    from bullet_trt.engine.idle_cache import IdleCacheRelease
    from tests.test_idle_cache import FakeAllocator

    alloc = FakeAllocator(reserved=1000 * MIB, allocated=1000 * MIB)
    reads = []

    def stats():
        reads.append(1)
        return alloc.stats()

    release = IdleCacheRelease("prefill", stats, alloc.release, limit_bytes=256 * MIB)
    watch = ReservedMemoryWatch("prefill", lambda: alloc.reserved, step_mib=128, idle_cache=release)
    reads.clear()
    alloc.cache(300)  # idle: released, so no growth
    assert watch.after_step(step([2048])) is None and alloc.releases == 1 and len(reads) == 2
    alloc.reserved += 200 * MIB
    alloc.allocated += 200 * MIB  # held by the step: growth
    assert "grew by 200 MiB" in watch.after_step(step([2048]))
