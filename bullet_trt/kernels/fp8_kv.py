"""K and V cached as FP8 (E4M3) at a scale of 1 (kv.cache_dtype=fp8): each value is rounded to
E4M3 as it is written and read back exactly by the attention kernels (decode's into fp16, prefill's
into the queries' dtype). No scale is kept, as vLLM keeps none without a checkpoint's; a value past
E4M3's 448 (rare after Qwen3's q/k norms, likelier without them) saturates there rather than
turning into NaN.

An FP8 cache keeps each block's V with its slots innermost, (block, head, dim, slot), where K and a
bf16 cache's V keep (block, slot, head, dim): the attention's product with V sums over keys, so its
operand wants keys adjacent. Read the other way, an 8-bit V reached the tensor cores a byte at a
time through shared memory (Triton has no transposing load for 8-bit data): the decode loop over
an FP8 cache compiled for sm_90 to 1162 instructions for its 32 KB of K and V against a bf16
cache's 372, and read at ~2.2 TB/s where bf16 reads at ~3.9 (docs/benchmarks.md, twenty-eighth
and thirtieth rounds). With slots innermost it compiles to 752 (tests/test_attention_kernels_compile.py)
and reads ~3.1 TB/s on an H200 (thirty-first round). The cache tensor keeps its shape, (2, blocks, slots, heads,
dim); ``v_view`` gives V in the usual order whatever the layout. The kernels read a block's run of
V slots whole, past a sequence's end too, and weigh those slots by zero: that holds because an
FP8 pool never holds NaN (it starts zeroed, every write saturates, kv_pool.fill_random draws
finite values), which E4M3's 0x7f and 0xff would be."""
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


def v_slots_inner(cache_dtype: torch.dtype | None) -> bool:
    """Whether a cache of ``cache_dtype`` keeps V as (block, head, dim, slot)."""
    return is_fp8(cache_dtype)


def v_view(kv_cache: torch.Tensor, slots_inner: bool) -> torch.Tensor:
    """The V half of one layer's cache (2, blocks, slots, heads, dim) as (blocks, slots, heads, dim),
    a view that writes through; ``slots_inner``: the cache keeps V slots-innermost (v_slots_inner of
    its dtype, passed apart so that a byte view of an FP8 cache keeps its layout)."""
    v = kv_cache[1]
    if not slots_inner:
        return v
    blocks, slots, heads, dim = v.shape
    return v.reshape(blocks, heads, dim, slots).permute(0, 3, 1, 2)


def standard_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A copy of one layer's cache with V as (blocks, slots, heads, dim), whatever its dtype keeps:
    what a reader that knows no layout (a dtype cast, a comparison) may take."""
    return torch.stack([kv_cache[0], v_view(kv_cache, v_slots_inner(kv_cache.dtype))])


def from_standard_layout(kv_cache: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``cache_dtype`` holding a standard-layout cache's K and V (cast to it as they are)."""
    out = torch.empty(kv_cache.shape, dtype=cache_dtype, device=kv_cache.device)
    out[0] = kv_cache[0].to(cache_dtype)
    v_view(out, v_slots_inner(cache_dtype))[:] = kv_cache[1].to(cache_dtype)
    return out
