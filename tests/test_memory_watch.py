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

