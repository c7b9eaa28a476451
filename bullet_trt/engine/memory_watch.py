"""Reports a worker's GPU memory at start and each time it grows while serving.

The KV pool is sized when the engine starts, from what the device has free then
(`kv.gpu_memory_fraction`); what the workers' caching allocators reserve later comes out of
the headroom the fraction leaves. On an 80 GB H100 that headroom ran out mid-run: the decode
worker grew from 10.10 to 10.38 GiB within one run and prefill steps failed for want of
tens of MiB (docs/benchmarks.md, "The H100's targets with decode planned past the SLO"). A
line in the server log per growth, naming the worker and the step that caused it, shows
which worker grows on which step shapes.

The lines found the decode worker's growth on the H200 (2026-11-26, seventh round): decode
graphs returned a float32 copy of each step's logits, a new allocator segment whenever the
batch grew (the sampler's buffer takes it now, engine/cuda_graphs.py). The prefill worker's
reserve grows too, to 4.16 GiB within two minutes on an H100 and 9.18 GiB on an H200 at
50 req/s: its idle cache is handed back between steps now (engine/idle_cache.py says why, and
what a cap on the allocator did instead). A watch made for a device does that too, before it
looks, from the same read of the allocator's books.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from bullet_trt.engine.idle_cache import IdleCacheRelease

if TYPE_CHECKING:
    from bullet_trt.engine.session import BatchItem

GIB = 2**30
MIB = 2**20


class ReservedMemoryWatch:
    def __init__(self, role: str, reserved: Callable[[], int], free: Callable[[], int] | None = None,
                 step_mib: int = 128, idle_cache: IdleCacheRelease | None = None):
        self.role = role
        self._reserved = reserved
        self._free = free
        self._idle_cache = idle_cache
        self.step_bytes = step_mib * MIB
        self.high = reserved()  # what the worker held when it began to serve

    @classmethod
    def for_device(cls, role: str, device: torch.device) -> "ReservedMemoryWatch | None":
        """A watch over this process's allocator on a GPU; None elsewhere (on CPU the pool is
        sized in host memory and nothing here applies)."""
        if device.type != "cuda":
            return None
        return cls(role, lambda: torch.cuda.memory_reserved(device),
                   lambda: torch.cuda.mem_get_info(device)[0],
                   idle_cache=IdleCacheRelease.for_device(role, device))

    def _device_free(self) -> str:
        return "" if self._free is None else f"; the device has {self._free() / GIB:.2f} GiB free"

    def started(self) -> str:
        line = f"bullet-trt: the {self.role} worker holds {self.high / GIB:.2f} GiB of GPU memory at start{self._device_free()}"
        print(line, file=sys.stderr, flush=True)
        return line

    def after_step(self, *parts: Sequence[BatchItem]) -> str | None:
        """Call after each step with its items (in as many parts as the step has); reports
        growth past the last reported figure by at least step_mib (a few lines a run, not one
        per step) and returns the line, else None. The step is only counted for a report: a
        decode step of a thousand rows would otherwise pay for it every time. With an idle
        cache to release, the release comes first and its read of the books is the one looked at."""
        if self._idle_cache is not None:
            self._idle_cache.after_step()
            now = self._idle_cache.reserved
        else:
            now = self._reserved()
        if now < self.high + self.step_bytes:
            return None
        grown = now - self.high
        self.high = now
        sequences = sum(len(part) for part in parts)
        tokens = sum(len(item.input_token_ids) for part in parts for item in part)
        line = (f"bullet-trt: the {self.role} worker's GPU memory grew by {grown / MIB:.0f} MiB to "
                f"{now / GIB:.2f} GiB on a step of {sequences} sequences and "
                f"{tokens} tokens{self._device_free()}")
        print(line, file=sys.stderr, flush=True)
        return line
