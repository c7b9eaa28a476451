"""Returns a worker's idle cached GPU memory to the device at the end of a step, once it has
grown by a limit.

PyTorch's caching allocator keeps a freed block for the stream it was allocated on, and a
worker steps on one stream per SM split (spatial/partitioners). Over a run the prefill
worker's cache grew as if it held a working set per split it had stepped on: on an H100 serving
44 req/s at TPOT <= 40 ms it grew from 0.06 GiB to 4.16 GiB within two minutes, until the
device had 0.03 GiB free (docs/benchmarks.md, 2026-11-26, seventh round), and the sixth
round's runs had lost requests to steps out of memory. Capping the allocator instead
(set_per_process_memory_fraction) made it free its whole cache in the middle of a step, at
every new block past the cap; those runs did worse.

Here the cache is emptied between steps, where the worker has already waited for its stream:
when the memory reserved but not allocated has grown `limit_bytes` past what the last release
left (at start: the graphs' private pools and what warm-up left, which this never counts
against the worker), `torch.cuda.empty_cache()` hands the idle blocks back, and the next steps
take what they need anew.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

GIB = 2**30
LIMIT_BYTES = GIB  # a few splits' prefill working sets of an 8B model: ~0.2-0.6 GiB each


class IdleCacheRelease:
    def __init__(self, role: str, stats: Callable[[], tuple[int, int]], release: Callable[[], None],
                 limit_bytes: int = LIMIT_BYTES):
        """stats() -> (reserved, allocated) bytes of this process's allocator."""
        self.role = role
        self._stats = stats
        self._release = release
        self.limit_bytes = limit_bytes
        reserved, allocated = stats()
        self.floor = reserved - allocated
        self.reserved = reserved  # what the allocator held at the last look, after any release
        self.releases = 0

    @classmethod
    def for_device(cls, role: str, device: torch.device) -> "IdleCacheRelease | None":
        """One over this process's allocator on a GPU; None elsewhere."""
        if device.type != "cuda":
            return None

        def stats() -> tuple[int, int]:
            s = torch.cuda.memory_stats(device)  # one read for both figures
            return s.get("reserved_bytes.all.current", 0), s.get("allocated_bytes.all.current", 0)

        return cls(role, stats, torch.cuda.empty_cache)

    def after_step(self) -> bool:
        """Call once the step's stream is done; returns whether it released the idle cache."""
        reserved, allocated = self._stats()
        self.reserved = reserved
        idle = reserved - allocated
        if idle < self.floor + self.limit_bytes:
            return False
        self._release()
        after_reserved, after_allocated = self._stats()
        self.reserved = after_reserved
        # what the release could not hand back (a graph pool's blocks, say) is the new floor
        self.floor = after_reserved - after_allocated
        self.releases += 1
        if self.releases & (self.releases - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... release
            print(f"bullet-trt: the {self.role} worker returned {(idle - self.floor) / GIB:.2f} GiB of idle "
                  f"cached GPU memory to the device (release {self.releases}); it holds "
                  f"{after_reserved / GIB:.2f} GiB", file=sys.stderr, flush=True)
        return True
