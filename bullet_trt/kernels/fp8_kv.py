"""K and V cached as FP8 (E4M3) at a scale of 1 (kv.cache_dtype=fp8): each value is rounded to
E4M3 as it is written and read back exactly by the attention kernels (decode's into fp16, prefill's
into the queries' dtype). No scale is kept, as vLLM keeps none without a checkpoint's; a value past
E4M3's 448 (rare after Qwen3's q/k norms, likelier without them) saturates there rather than
turning into NaN."""
from __future__ import annotations

import torch

from bullet_trt.kernels.fp8_blocks import FP8, FP8_MAX


def is_fp8(cache_dtype: torch.dtype | None) -> bool:
    return cache_dtype == FP8


def saturation(cache_dtype: torch.dtype) -> float:
    """The bound values written to a cache of this dtype are clamped to (0: none)."""
    return FP8_MAX if is_fp8(cache_dtype) else 0.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``cache_dtype`` stores it."""
    bound = saturation(cache_dtype)
    if bound:
        x = x.float().clamp(-bound, bound)
    return x.to(cache_dtype)
