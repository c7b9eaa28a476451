"""How many SMs the current stream's kernels plan for: the whole device, or the SM partition
the engine moved this process's work onto (``set_num_sms``, called before capturing or running
on a partition). The decode attention's split count, the MoE kernels' tile table and cuBLASLt
read it. Its own module, without Triton, so that every kernel module can read it without
importing another."""
from __future__ import annotations

import functools

import torch

_NUM_SMS: int | None = None


def set_num_sms(n: int | None) -> None:
    """The number of SMs the current stream may use; None returns to the whole device. cuBLASLt
    plans for it too (triton_ops.use_cublaslt)."""
    global _NUM_SMS
    if n is not None and int(n) < 1:
        raise ValueError(f"set_num_sms: SM count must be >= 1, got {n}")
    _NUM_SMS = None if n is None else int(n)
    if torch.cuda.is_available() and hasattr(torch._C, "_set_sm_carveout_experimental"):
        total = device_sms(torch.cuda.current_device())
        # The carve-out is what cuBLASLt leaves to others: it plans for total - carve-out SMs.
        torch._C._set_sm_carveout_experimental(None if _NUM_SMS is None or _NUM_SMS >= total
                                               else total - _NUM_SMS)


@functools.lru_cache(maxsize=None)
def device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def whole_device_sms(device: torch.device | str | None = None) -> int:
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":  # Triton interpreter runs on CPU tensors: pretend an H100
        return 132
    return device_sms(device.index if device.index is not None else torch.cuda.current_device())


def get_num_sms(device: torch.device | str | None = None) -> int:
    return _NUM_SMS if _NUM_SMS is not None else whole_device_sms(device)
