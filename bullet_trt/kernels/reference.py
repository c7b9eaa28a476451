"""Plain torch implementations of every kernel: the CPU path and the oracle for GPU kernels.

Shapes: packed tokens T, query heads Hq, KV heads Hkv, head dim D. A layer's KV cache is one
tensor (2, num_blocks, block_size, Hkv, D): index 0 holds K, index 1 holds V.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bullet_trt.kernels import fp8_blocks, fp8_kv
from bullet_trt.kernels.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the pre-norm residual stream step."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, Hq, D) and k (T, Hkv, D), neox style (halves), as Llama does.

    cos_sin_cache is (max_positions, D): the first D/2 columns cos, the last D/2 sin.
    """
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows (T, Hkv, D) into their paged slots of one layer's cache (an FP8 cache:
    rounded to it, saturating)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    slots_inner = fp8_kv.v_slots_inner(kv_cache.dtype)
    k, v = fp8_kv.to_cache(k, kv_cache.dtype), fp8_kv.to_cache(v, kv_cache.dtype)
    if fp8_kv.is_fp8(kv_cache.dtype):  # the CPU's index_copy_ has no FP8 kernel: copy the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, k)
    if slots_inner:
        fp8_kv.v_view(kv_cache, True)[slot_mapping // block_size, slot_mapping % block_size] = v
    else:
        flat[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of the packed new queries over each sequence's cached context.

    The new tokens' K/V must already be in the cache (write_kv_cache first).
    Returns (T, Hq, D) in q's dtype.
    """
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    tables = meta.block_tables
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    for i, total in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        q_len = end - start
        num_blocks = (total + block_size - 1) // block_size
        blocks = tables[i, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, kv_cache.shape[-1])[:total]
        v = fp8_kv.v_view(kv_cache, fp8_kv.v_slots_inner(kv_cache.dtype))[blocks]
        v = v.reshape(-1, num_kv_heads, kv_cache.shape[-1])[:total]
        qi = q[start:end].float().transpose(0, 1)  # (Hq, q_len, D)
        ki = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(total - q_len, total, device=q.device).unsqueeze(1)
        k_pos = torch.arange(total, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        scores = (qi @ ki.transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return out


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in the logits' dtype, expert ids (T, k) int32): the softmax over the
    experts in fp32, its top k, renormalised to sum to 1 when ``renormalize`` (Qwen3-MoE's
    ``norm_topk_prob``), as transformers' Qwen3-MoE router computes them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_offset: int = 0, gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None, fp8_activations: bool = False) -> torch.Tensor:
    """The experts' part of a MoE layer: for each token, the sum over its k experts e of
    weight * down_e(silu(gate_e(x)) * up_e(x)).

    x (T, H); w_gate_up (E_local, 2I, H), each expert's gate rows then its up rows; w_down
    (E_local, H, I); topk_weights, topk_ids (T, k). The weights hold experts expert_offset ..
    expert_offset + E_local - 1 (all of them without expert parallelism); assignments to other
    experts add nothing here, so ranks that hold disjoint ranges sum their outputs.

    The token-expert assignments are sorted by expert and each expert's rows run as one pair
    of GEMMs, the grouped GEMM the Triton kernel tiles; the per-expert loop and its host sync
    are fine on CPU. Accumulation follows transformers (in x's dtype, expert by expert).

    With ``gate_up_scale`` and ``down_scale`` the weights are FP8 blocks (fp8_blocks.py), used
    as the x-dtype weights they stand for; ``fp8_activations``: both products' inputs (x, and
    each assignment's silu(gate) * up) are rounded to FP8 per token and 128 columns first.
    """
    if gate_up_scale is not None:
        w_gate_up = fp8_blocks.dequantize_gate_up(w_gate_up, gate_up_scale, x.dtype)
        w_down = fp8_blocks.dequantize(w_down, down_scale, x.dtype)
    elif fp8_activations:
        raise ValueError("fused_moe: FP8 activations go with FP8 weights (gate_up_scale, down_scale)")

    def rounded(rows: torch.Tensor) -> torch.Tensor:
        if not fp8_activations:
            return rows
        return fp8_blocks.dequantize_token_groups(*fp8_blocks.quantize_token_groups(rows), rows.dtype)

    x_in = rounded(x)
    num_local, k = w_gate_up.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    local = topk_ids.reshape(-1).long() - expert_offset
    order = torch.argsort(local, stable=True)  # assignment ids (token * k + slot) by expert
    bounds = torch.searchsorted(local[order], torch.arange(num_local + 1, device=x.device)).tolist()
    flat_weights = topk_weights.reshape(-1)
    for e in range(num_local):
        ids = order[bounds[e]:bounds[e + 1]]
        if ids.numel() == 0:
            continue
        tokens = ids // k
        act = rounded(silu_and_mul(x_in[tokens] @ w_gate_up[e].t()))
        y = (act @ w_down[e].t()) * flat_weights[ids, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


_MASK32 = 0xFFFFFFFF
GUMBEL_ROWS_AT_ONCE = 16  # the per-element hash holds a few int64 (rows, vocab) tensors


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors kept in 32 bits; products wrap mod 2^64, which
    leaves the low 32 bits exact on every device."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_argmax(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                  keys: torch.Tensor) -> torch.Tensor:
    """For each i, the token a seeded categorical draw picks from row rows[i] of logits (B, V)
    at temperature[i] (> 0): argmax over v of logits/temperature (in float32) plus the Gumbel
    noise -log(-log(u)), u = (hash(keys[i], v) + 0.5) / 2^32 in float64. The noise is a pure
    function of the row's key (engine/sampling.row_keys) and the vocabulary index, so a seeded
    request draws the same tokens whatever shares its batch. Ties go to the lowest index.
    int64 (len(rows),). Rows are taken a few at a time: the hash's int64 temporaries would be
    gigabytes for a thousand rows of a 128k vocabulary."""
    vocab = logits.shape[1]
    idx = torch.arange(vocab, device=logits.device, dtype=torch.int64).unsqueeze(0)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    for start in range(0, rows.shape[0], GUMBEL_ROWS_AT_ONCE):
        sl = slice(start, start + GUMBEL_ROWS_AT_ONCE)
        scaled = logits[rows[sl].long()].float() / temperature[sl].float().unsqueeze(1)
        out[sl] = (scaled.double() + gumbel_noise(keys[sl], idx)).argmax(dim=-1)
    return out


def gumbel_noise(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """float64 Gumbel noise -log(-log(u)) of vocabulary indices idx (R, K) or (1, K) under row
    keys (R,): u = (hash(key, index) + 0.5) / 2^32, the same for an index wherever it stands."""
    key = keys.long().unsqueeze(1)
    h = fmix32(fmix32((key ^ ((idx * 0x27D4EB2F) & _MASK32)) & _MASK32) ^ key)
    u = (h.double() + 0.5) / 4294967296.0
    return -torch.log(-torch.log(u))
