"""Reports a worker's GPU memory at start and each time it grows while serving.

The KV pool is sized when the engine starts, from what the device has free then
(`kv.gpu_memory_fraction`); what the workers' caching allocators reserve later comes out of
the headroom the fraction leaves. On an 80 GB H100 that headroom ran out mid-run: the decode
worker grew from 10.10 to 10.38 GiB within one run and prefill steps failed for want of
tens of MiB (docs/benchmarks.md, "The H100's targets with decode planned past the SLO"). A
line in the server log per growth, naming the worker and the step that caused it, shows
which worker grows on which step shapes. (The growth suspected there, sampling's float32 copy
of each step's logits, now has a buffer made at start: engine/sampling.float32_scratch.)
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

GIB = 2**30
MIB = 2**20


class ReservedMemoryWatch:
    def __init__(self, role: str, reserved: Callable[[], int], free: Callable[[], int] | None = None,
                 step_mib: int = 128):
        self.role = role
        self._reserved = reserved
        self._free = free
        self.step_bytes = step_mib * MIB
        self.high = reserved()  # what the worker held when it began to serve

    @classmethod
    def for_device(cls, role: str, device: torch.device) -> "ReservedMemoryWatch | None":
        """A watch over this process's allocator on a GPU; None elsewhere (on CPU the pool is
        sized in host memory and nothing here applies)."""
        if device.type != "cuda":
            return None
        return cls(role, lambda: torch.cuda.memory_reserved(device),
                   lambda: torch.cuda.mem_get_info(device)[0])

    def _device_free(self) -> str:
        return "" if self._free is None else f"; the device has {self._free() / GIB:.2f} GiB free"

    def started(self) -> str:
        line = f"bullet-trt: the {self.role} worker holds {self.high / GIB:.2f} GiB of GPU memory at start{self._device_free()}"
        print(line, file=sys.stderr, flush=True)
        return line

    def after_step(self, token_counts: Sequence[int]) -> str | None:
        """Call after each step with the new tokens of each of its sequences; reports growth
        past the last reported figure by at least step_mib (a few lines a run, not one per
        step) and returns the line, else None."""
        now = self._reserved()
        if now < self.high + self.step_bytes:
            return None
        grown = now - self.high
        self.high = now
        line = (f"bullet-trt: the {self.role} worker's GPU memory grew by {grown / MIB:.0f} MiB to "
                f"{now / GIB:.2f} GiB on a step of {len(token_counts)} sequences and "
                f"{sum(token_counts)} tokens{self._device_free()}")
        print(line, file=sys.stderr, flush=True)
        return line
