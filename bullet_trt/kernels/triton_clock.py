"""The GPU's own clock, read on a stream: a one-program kernel stores PTX's %globaltimer (a
nanosecond counter of the device, the same register for every context and process on it).

Two worker processes' CUDA events cannot be compared (an event shared between processes
carries no time), and their host clocks see a step from its launch to its synchronize, not
when its kernels ran. A stamp queued in front of a step and one behind it, on the step's own
stream and partition, bound the step as the GPU ran it, in one clock for both workers.
Imported only on CUDA, like the other Triton modules.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def globaltimer():
    """The device timer (ns) as a Triton value, for kernels that read it (also the doctor's
    SM-id probe)."""
    # not pure: two reads of the timer must not be merged or hoisted
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _store_globaltimer(out_ptr, SLOT: tl.constexpr):
    tl.store(out_ptr + SLOT, globaltimer())


def stamp_globaltimer(out: torch.Tensor, slot: int) -> None:
    """Queues, on the current stream, the store of the GPU's timer (ns) into out[slot] (int64,
    on the GPU) when the stream reaches it."""
    _store_globaltimer[(1,)](out, SLOT=slot, num_warps=1)
