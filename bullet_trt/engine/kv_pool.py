"""The paged KV pool: one tensor holding every layer's K and V blocks.

Layout (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), where num_kv_heads
are the heads this rank holds under tensor parallelism (all of them on one rank). One tensor is one
allocation, so one shared-memory segment on CPU or one CUDA IPC handle on GPU lets another
process attach the whole pool without copying.
"""
from __future__ import annotations

import torch

from bullet_trt.kernels.fp8_blocks import FP8
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.tensor_parallel import Shard


# FP8 conversions (and Triton's fp8e4nv) need Ada or Hopper tensor cores
FP8_MIN_CAPABILITY = (8, 9)


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element type for ``kv.cache_dtype`` (config.KV_CACHE_DTYPES)."""
    if cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        raise ValueError(f"kv.cache_dtype=fp8 needs a GPU of compute capability "
                         f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later (FP8 conversions); "
                         f"{torch.cuda.get_device_name(device)} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return FP8


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, shard: Shard = Shard()) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * shard.kv_heads(arch)[1] * arch.head_dim * elem


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def create_kv_pool(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str, shared: bool = False, shard: Shard = Shard()) -> torch.Tensor:
    pool = torch.zeros(arch.num_layers, 2, num_blocks, block_size, shard.kv_heads(arch)[1],
                       arch.head_dim, dtype=dtype, device=device)
    if shared and pool.device.type == "cpu":
        pool.share_memory_()
    return pool


def fill_random(pool: torch.Tensor) -> None:
    """Standard-normal K/V in every slot, for timing attention over cached tokens of data rather
    than zeros. An FP8 pool has no random kernel: one layer's half at a time is drawn in
    bfloat16 and rounded to it."""
    if pool.dtype != FP8:
        pool.normal_()
        return
    for layer in pool:
        for half in layer:
            half.copy_(torch.randn(half.shape, dtype=torch.bfloat16, device=half.device))


def size_pool(arch: ModelArch, block_size: int, dtype: torch.dtype, device: torch.device,
              num_blocks: int, gpu_memory_fraction: float, cpu_pool_mib: int,
              min_blocks: int, shard: Shard = Shard()) -> int:
    """Number of blocks: the configured count, or what the memory budget holds.

    On GPU the budget is ``gpu_memory_fraction`` of the total memory minus what is already
    in use (the weights), so call this after loading the model.
    """
    per_block = bytes_per_block(arch, block_size, dtype, shard)
    if num_blocks:
        count = num_blocks
        budget_hint = "kv.num_blocks"
    elif device.type == "cuda":
        # The allocator's idle cache goes back to the driver first: the pool is one large
        # allocation that cannot reuse those scattered blocks (the separate q/k/v and gate/up
        # tensors freed when the fused groups were laid out), so counting the cache as free
        # left it held beside the pool, gigabytes over the budget.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        count = int((total * gpu_memory_fraction - used) // per_block)
        budget_hint = f"kv.gpu_memory_fraction={gpu_memory_fraction}"
    else:
        count = cpu_pool_mib * 2**20 // per_block
        budget_hint = f"kv.cpu_pool_mib={cpu_pool_mib}"
    if count < min_blocks:
        raise ValueError(
            f"KV pool too small: {budget_hint} gives {count} blocks of {block_size} tokens "
            f"({per_block} bytes each) but one sequence of the profile's max_model_len needs "
            f"{min_blocks}; raise the budget or lower max_model_len")
    return count
