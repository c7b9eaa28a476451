"""Host lists to device tensors without waiting for the GPU."""
from __future__ import annotations

import torch


def device_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list or a numpy array) as a tensor on `device`. Staged through pinned memory,
    so the copy is queued behind the steps already on the stream instead of waiting for them: a
    copy from pageable memory synchronizes with the stream, which would undo a step launched
    ahead."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
