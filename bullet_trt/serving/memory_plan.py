"""What one GPU holds when a model is served on it, or on one of `tp` tensor-parallel ranks:
its share of the weights, the KV pool left beside them, and how many decoding rows that pool
keeps at a typical context. Device sizing uses it for the GPU it runs on; `bullet-trt plan`
prints it for GPUs and TP sizes not at hand (the large runs are planned with it before a
machine of several GPUs is at hand).

Sharding is Megatron's: attention heads, MLP columns, experts and the vocabulary split
`tp` ways; KV heads too while there are at least `tp` of them, else each rank keeps the one
its query heads read (replicated).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bullet_trt.kernels import fp8_blocks
from bullet_trt.model.arch import ModelArch

GiB = 2**30
TYPICAL_CONTEXT = 512  # tokens a decoding row holds on average in ShareGPT-like serving (~500)


@dataclass(frozen=True)
class RankMemory:
    tp: int
    weight_bytes: float  # this rank's share, embedding and lm_head included
    kv_bytes_per_token: float  # this rank's KV heads, all layers
    pool_bytes: float  # the KV pool: the memory budget less the weights (negative: no fit)
    context: int

    @property
    def fits(self) -> bool:
        return self.pool_bytes >= self.kv_bytes_per_token * self.context

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.pool_bytes // self.kv_bytes_per_token))

    @property
    def rows(self) -> int:
        """Decoding rows whose KV the pool holds at once at `context` tokens each."""
        return self.kv_tokens // self.context


def parameters(arch: ModelArch) -> int:
    """Every weight the checkpoint holds (norms aside): attention, MLPs or experts and routers,
    the embedding, and the lm_head unless tied to it."""
    h, layers = arch.hidden_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    moe = len(arch.moe_layers)
    attention = layers * (h * (q + 2 * kv) + q * h)
    mlp = (layers - moe) * 3 * h * arch.intermediate_size
    experts = moe * (arch.num_experts * 3 * h * arch.moe_intermediate_size + h * arch.num_experts)
    vocab = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return attention + mlp + experts + vocab


def kv_heads_per_rank(arch: ModelArch, tp: int) -> int:
    return max(1, math.ceil(arch.num_kv_heads / tp))


def expert_parameters(arch: ModelArch) -> int:
    """The experts' weights alone (routers aside): what FP8 experts hold at a byte each."""
    return len(arch.moe_layers) * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size


def kv_value_bytes(cache_dtype: str, dtype_bytes: int) -> int:
    """A cached K or V value's bytes under ``kv.cache_dtype``."""
    return 1 if cache_dtype == "fp8" else dtype_bytes


def plan_rank(arch: ModelArch, dtype_bytes: int, tp: int, gpu_memory_bytes: float,
              memory_fraction: float, context: int = TYPICAL_CONTEXT, fp8_experts: bool = False,
              kv_dtype_bytes: int | None = None) -> RankMemory:
    """``fp8_experts``: the experts at one byte a weight and a float32 scale per 128 x 128 block;
    ``kv_dtype_bytes``: a cached K or V value's bytes (None: dtype_bytes)."""
    if tp < 1 or arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size must divide the {arch.num_heads} attention heads, got {tp}")
    # replicated KV heads add their K/V projections to every rank's share
    kv_rep = kv_heads_per_rank(arch, tp) * tp / arch.num_kv_heads
    extra_kv_proj = arch.num_layers * 2 * arch.hidden_size * arch.num_kv_heads * arch.head_dim * (kv_rep - 1)
    experts = expert_parameters(arch) if fp8_experts else 0
    weights = ((parameters(arch) - experts + extra_kv_proj) * dtype_bytes + experts * fp8_blocks.BYTES_PER_WEIGHT) / tp
    kv_per_token = 2.0 * arch.num_layers * kv_heads_per_rank(arch, tp) * arch.head_dim * (kv_dtype_bytes or dtype_bytes)
    return RankMemory(tp, weights, kv_per_token, gpu_memory_bytes * memory_fraction - weights, context)


def table(arch_name: str, arch: ModelArch, dtype_bytes: int, tps: list[int], gpu_memory_gib: float,
          memory_fraction: float, fp8_experts: bool = False, kv_dtype_bytes: int | None = None) -> str:
    experts = (" (FP8 experts)" if fp8_experts else "") + (" (FP8 KV cache)" if kv_dtype_bytes == 1 else "")
    lines = [f"{arch_name}: {parameters(arch) / 1e9:.1f}B parameters, {dtype_bytes}-byte weights{experts}, "
             f"{gpu_memory_gib:g} GiB GPUs at kv.gpu_memory_fraction {memory_fraction:g}",
             "", "| TP | weights per GPU | KV per token per GPU | KV pool per GPU | tokens in the pool "
             f"| rows at {TYPICAL_CONTEXT} tokens | fits |", "|---|---|---|---|---|---|---|"]
    for tp in tps:
        r = plan_rank(arch, dtype_bytes, tp, gpu_memory_gib * GiB, memory_fraction, fp8_experts=fp8_experts,
                      kv_dtype_bytes=kv_dtype_bytes)
        lines.append(f"| {tp} | {r.weight_bytes / GiB:.1f} GiB | {r.kv_bytes_per_token / 1024:.0f} KiB "
                     f"| {max(r.pool_bytes, 0) / GiB:.1f} GiB | {r.kv_tokens:,} | {r.rows:,} "
                     f"| {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)
