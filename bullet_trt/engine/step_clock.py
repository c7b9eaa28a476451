"""When a worker's step ran on the GPU, in the GPU's own clock (kernels/triton_clock.py).

The host clock brackets a step from its first launch to its synchronize, so it also counts
launch latency and the wake-up after the last kernel; two workers' host windows can overlap
where their kernels did not. The stamps here are queued on the step's own stream, one before
its first kernel and one after its last, and both workers read the same device timer, so the
overlap of a prefill and a decode step is measured where it happens (bench overlap).
"""
from __future__ import annotations

import torch


class GpuStepClock:
    def __init__(self, device: torch.device):
        from bullet_trt.kernels.triton_clock import stamp_globaltimer
        self._stamp = stamp_globaltimer
        self._on_gpu = torch.zeros(2, dtype=torch.int64, device=device)
        self._on_host = torch.zeros(2, dtype=torch.int64, pin_memory=True)

    def warm_up(self) -> None:
        """Stamps once on the current stream, so that the stamp's kernel is compiled and loaded
        there before a step needs it."""
        self.begin()
        self.finish()

    def begin(self) -> None:
        """Queues the start stamp on the current stream (before the step's work)."""
        self._stamp(self._on_gpu, 0)

    def finish(self) -> None:
        """Queues the end stamp and its copy to the host on the current stream (after the
        step's work); the caller's synchronize of that stream makes window_ns() valid."""
        self._stamp(self._on_gpu, 1)
        self._on_host.copy_(self._on_gpu, non_blocking=True)

    def window_ns(self) -> tuple[int, int]:
        start, end = self._on_host.tolist()
        return start, end
