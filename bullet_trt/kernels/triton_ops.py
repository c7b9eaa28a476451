"""Triton GPU kernels with the same names and signatures as ``reference.py``.

Imported only on CUDA (``ops_for``); this module, the ones it gathers the MoE ops and the
sampler's draw from (``triton_moe.py``, ``triton_sample.py``), their shared tile product
(``triton_dot.py``) and the GPU clock (``triton_clock.py``) are the only ones that import
Triton. Every kernel accumulates in fp32 and takes bf16, fp16 or fp32 tensors.

Attention reads K/V straight from the paged cache (2, num_blocks, block_size, Hkv, D):

- decode (``meta.max_seqlen_q == 1``): split-KV flash-decoding. Grid (seq, kv_head, split);
  one program holds all G = Hq/Hkv query heads of its KV head, so each K/V tile is read once
  per group. With more than one split a second kernel merges the partial results by their
  log-sum-exp. The split count depends only on host ints (batch, max_seqlen_k, the SM count
  from ``set_num_sms``); each program derives its token range from ``seq_lens`` on the device,
  so a captured CUDA graph stays correct for any context length, and nothing syncs the host.
- prefill / chunked prefill / mixed: flash attention over the packed variable-length queries
  (grid (kv_head, query block), heaviest causal blocks first),
  causal with the offset ``seq_lens[s] - q_len_s``. A tile's rows are (token, head-of-group)
  pairs, so GQA heads share K/V loads too. The mapping from program to (sequence, query
  block) is computed inside the kernel from ``cu_seqlens_q`` (no host sync). In a mixed batch
  the single-token sequences go through the decode kernel instead (``MIXED_DECODE_SPLIT``),
  the others through the prefill kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bullet_trt.kernels import fp8_kv
from bullet_trt.kernels.metadata import AttentionMetadata
from bullet_trt.kernels.sm_budget import get_num_sms, set_num_sms
from bullet_trt.kernels.triton_dot import UPCAST_DOT, mm
from bullet_trt.kernels.triton_moe import compile_moe_variants, fused_moe, moe_route
from bullet_trt.kernels.triton_sample import gumbel_argmax, nucleus_tail_draw

__all__ = ["rms_norm", "add_rms_norm", "silu_and_mul", "apply_rope", "write_kv_cache",
           "paged_attention", "set_num_sms", "get_num_sms", "decode_splits_for",
           "compile_decode_variants", "moe_route", "fused_moe", "compile_moe_variants", "gumbel_argmax",
           "nucleus_tail_draw"]

LOG2E = 1.4426950408889634

# Mixed batches: single-token sequences take the split-KV decode kernel (True) or go through
# the prefill kernel with the rest (False). Both are exact; tests/gpu/test_triton_kernels.py
# tests both.
MIXED_DECODE_SPLIT = True

# Tile configurations, keyed by (fp32 inputs, head_dim > 128). Module-level so that
# `bullet-trt bench kernels --sweep` can sweep them; the engine never needs to touch them.
# Chosen so that sm_90 builds do not spill registers (checked with ptxas); fp32 takes the exact
# (FMA, "ieee") dot path and exists for tests, not speed.
DECODE_CONFIGS = {
    (False, False): dict(BLOCK_N=64, num_warps=4, num_stages=2),
    (False, True): dict(BLOCK_N=32, num_warps=4, num_stages=2),
    (True, False): dict(BLOCK_N=32, num_warps=8, num_stages=2),
    (True, True): dict(BLOCK_N=16, num_warps=8, num_stages=2),
}
# Over an FP8 cache (kv.cache_dtype=fp8), keyed by head dim > 128: a tile moves half the bytes, so
# twice the keys a tile. Swept on an H200 at Qwen3-30B-A3B's heads, 640 rows of 600 tokens
# (docs/benchmarks.md, twenty-eighth round): 0.183 ms a layer against the bf16 cache's 0.203 ms
# (3.9 TB/s); the FP8 cache's rate stays near 2.2 TB/s whatever the tile, the loop and not HBM
# bounding it. That sweep read V across its slots; with V slots-innermost (fp8_kv.py) this tile
# reads 3.1 TB/s, 0.131 ms a layer, the sweep's best (2 stages) 2% faster (thirty-first round).
# Head dims above 128 keep the bf16 cache's tile (not swept).
DECODE_CONFIGS_FP8_CACHE = {
    False: dict(BLOCK_N=128, num_warps=4, num_stages=3),
    True: dict(BLOCK_N=32, num_warps=4, num_stages=2),
}
# Over an FP8 cache, decode's products take K and V converted to fp16 (E4M3 is exact in either, and
# a bf16 query is too, bar values past fp16's range) rather than to the queries' bf16: at the tile
# above 0.183 ms against 0.199 (the same sweep).
FP8_CACHE_DOT_FP16 = True
PREFILL_CONFIGS = {
    (False, False): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    (False, True): dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
    (True, False): dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2),
    (True, True): dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2),
}
# Decode split policy: aim for this many programs per SM, never fewer tokens per split than
# MIN_SPLIT_TOKENS, never more than MAX_SPLITS splits.
DECODE_PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
# Fixed split count for every decode call when set (tests and sweeps); None: the policy above.
DECODE_SPLITS_OVERRIDE: int | None = None

# Set by the kernel tests: fresh outputs start as NaN so unwritten elements show up.
_POISON = False


def use_cublaslt() -> None:
    """Routes torch's GEMMs through cuBLASLt. cuBLAS sizes a GEMM's grid for every SM of the
    device, so on a green partition the grid can take an extra, mostly idle wave; cuBLASLt
    takes the SM count to plan for (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, set by set_num_sms).
    Measured on an H200 (now `bullet-trt bench kernels --compare-blas`): decode steps 13-15% faster on
    32-104 SM partitions, prefill up to 17%, and 2-3% faster on the whole GPU."""
    torch.backends.cuda.preferred_blas_library("cublaslt")


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D (rows, cols) with unit column stride, a view where possible."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


# ---------------------------------------------------------------------------- RMSNorm

# Integer arguments that change from batch to batch (row counts, sequence counts, block-table
# widths) are kept out of Triton's specialization (value 1, divisible by 16): otherwise each
# new combination of those properties compiles another form of the kernel, ~0.6 s in the
# middle of serving, which a warm-up cannot enumerate. Measured in chunked serving on an
# H200 (docs/gpu-evidence.md); strides fixed by the model stay specialized.


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(X, R, W, Y, S, n_rows, n_cols, stride_x, stride_r, stride_y, stride_s, eps,
                     heads, stride_xh,
                     HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows of X are (token, head) pairs when ``heads`` > 1: row r at (r // heads) * stride_x +
    (r % heads) * stride_xh, so the heads of a fused q/k/v projection are normed where they lie."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    rows = rows.to(tl.int64)
    x_rows = (rows // heads) * stride_x + (rows % heads) * stride_xh
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # Rounded to the stream's dtype before the norm, as the reference's ``x + residual``.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    # The reference rounds the normalized value to the input dtype before the weight multiply.
    xn = (xf * rstd[:, None]).to(S.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty),
             mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float):
    shape = x.shape
    n_cols = shape[-1]
    if weight.shape[-1] != n_cols or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
    # (tokens, heads, dim) with unit dim stride: normed in place of a copy (q and k are views
    # into the fused q/k/v projection's rows, which reshape would copy, two launches a layer)
    headwise = residual is None and x.dim() == 3 and x.stride(-1) == 1
    x2 = x if headwise else _rows(x)
    heads, stride_xh = (x.shape[1], x.stride(1)) if headwise else (1, 0)
    n_rows = x2.shape[0] * heads
    stream_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(stream_dtype, weight.dtype)
    y = _empty((n_rows, n_cols), out_dtype, x.device)
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(shape)}")
        r2 = _rows(residual)
        s = _empty((n_rows, n_cols), stream_dtype, x.device)
    else:
        r2, s = x2, x2  # S only lends its dtype when there is no residual
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if n_rows > 0:
        block_n = triton.next_power_of_2(n_cols)
        block_m = max(1, min(64, 4096 // block_n))
        num_warps = max(1, min(16, block_m * block_n // 512))
        grid = (triton.cdiv(n_rows, block_m),)
        _rms_norm_kernel[grid](x2, r2, weight, y, s, n_rows, n_cols, x2.stride(0), r2.stride(0),
                               y.stride(0), s.stride(0), float(eps), heads, stride_xh,
                               HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                               num_warps=num_warps)
    y = y.view(shape)
    return y if residual is None else (y, s.view(shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs are not modified."""
    return _launch_rms_norm(x, residual, weight, eps)


# ---------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_and_mul_kernel(X, Y, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    shape = gate_up.shape
    if shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {shape[-1]} is odd")
    n_cols = shape[-1] // 2
    x2 = _rows(gate_up)
    n_rows = x2.shape[0]
    y = _empty((n_rows, n_cols), gate_up.dtype, gate_up.device)
    if n_rows > 0 and n_cols > 0:
        block = min(1024, triton.next_power_of_2(n_cols))
        grid = (n_rows, triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x2, y, n_cols, x2.stride(0), y.stride(0), BLOCK=block,
                                   num_warps=4)
    return y.view(*shape[:-1], n_cols)


# ---------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(Q, K, QO, KO, POS, CS, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(CS + pos * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CS + pos * stride_cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)

    mask = (h < HQ)[:, None] & dmask[None, :]
    src = Q + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = QO + t * stride_qot + h[:, None] * stride_qoh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(QO.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(QO.dtype.element_ty), mask=mask)

    mask = (h < HK)[:, None] & dmask[None, :]
    src = K + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = KO + t * stride_kot + h[:, None] * stride_koh + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(KO.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(KO.dtype.element_ty), mask=mask)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, Hq, D) and k (T, Hkv, D), neox style; returns new tensors."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    T, HQ, D = q.shape
    HK = k.shape[1]
    if D % 2 or k.shape[0] != T or k.shape[2] != D or cos_sin_cache.shape[-1] != D:
        raise ValueError(f"apply_rope: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"cos_sin_cache {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    qo = _empty((T, HQ, D), q.dtype, q.device)
    ko = _empty((T, HK, D), k.dtype, k.device)
    if T > 0:
        half = D // 2
        block_h = triton.next_power_of_2(max(HQ, HK))
        block_half = triton.next_power_of_2(half)
        num_warps = max(1, min(8, block_h * block_half // 256))
        _rope_kernel[(T,)](q, k, qo, ko, positions, cos_sin_cache, q.stride(0), q.stride(1),
                           k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0),
                           ko.stride(1), cos_sin_cache.stride(0), HQ=HQ, HK=HK, HALF=half,
                           BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps)
    return qo, ko


# ---------------------------------------------------------------------------- KV cache write


@triton.jit
def _write_kv_kernel(K, V, C, SLOT, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c2, stride_cb, stride_co, stride_ch,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr,
                     V_SLOTS_INNER: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    valid = slot >= 0  # negative slots (padding rows) are skipped
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = ((h < H)[:, None] & (d < D)[None, :]) & valid
    dst = C + blk * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :]
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if SATURATE > 0:  # an FP8 cache: out-of-range values clamp to its largest finite value
        k = tl.minimum(tl.maximum(k.to(tl.float32), -SATURATE), SATURATE)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -SATURATE), SATURATE)
    tl.store(dst, k.to(C.dtype.element_ty), mask=mask)
    if V_SLOTS_INNER:  # V as (block, head, dim, slot): fp8_kv.py says why
        v_dst = C + stride_c2 + blk * stride_cb + (h[:, None] * D + d[None, :]) * BLOCK_SIZE + off
        tl.store(v_dst, v.to(C.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + stride_c2, v.to(C.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows (T, Hkv, D) into their paged slots of one layer's cache (an FP8 cache:
    rounded to it, saturating)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: the cache's last dim must be contiguous")
    _check_v_layout(kv_cache, "write_kv_cache")
    T, H, D = k.shape
    if v.shape != k.shape or kv_cache.shape[3] != H or kv_cache.shape[4] != D:
        raise ValueError(f"write_kv_cache: k {tuple(k.shape)} v {tuple(v.shape)} cache {tuple(kv_cache.shape)}")
    if slot_mapping.shape[0] != T:
        raise ValueError(f"write_kv_cache: {slot_mapping.shape[0]} slots for {T} tokens")
    if T == 0:
        return
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    num_warps = max(1, min(8, block_h * block_d // 512))
    _write_kv_kernel[(T,)](k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                           kv_cache.stride(3), H=H, D=D, BLOCK_SIZE=kv_cache.shape[2],
                           BLOCK_H=block_h, BLOCK_D=block_d, SATURATE=fp8_kv.saturation(kv_cache.dtype),
                           V_SLOTS_INNER=fp8_kv.v_slots_inner(kv_cache.dtype), num_warps=num_warps)


def _check_v_layout(kv_cache: torch.Tensor, who: str) -> None:
    # a cache keeping V slots-innermost is addressed from its block's start, not by strides
    if fp8_kv.v_slots_inner(kv_cache.dtype) and not kv_cache.is_contiguous():
        raise ValueError(f"{who}: an FP8 cache must be contiguous (its V is laid out within each block)")


@triton.jit
def _load_v_slots_inner(V_PLANE, table, n0, end, kvh, d, dmask, stride_kvb,
                        D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N of V kept as (block, head, dim, slot), as a (BLOCK_N, BLOCK_D) tile:
    a block's run of slots at a time, so that the loads and the product's operand both take keys
    adjacent. n0 must be a multiple of BLOCK_N. A run is read whole once its first key is before
    ``end`` (a mask per key would split the 16-byte loads into single bytes): its slots past the end
    lie in a block the sequence holds and count for nothing, their scores masked to zero weight,
    as long as they hold no NaN, which an FP8 pool never does (fp8_kv.py)."""
    SUB: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_SIZE else BLOCK_SIZE
    RUNS: tl.constexpr = BLOCK_N // SUB
    first = n0 + tl.arange(0, RUNS) * SUB
    blk = tl.load(table + first // BLOCK_SIZE, mask=first < end, other=0).to(tl.int64)
    base = blk * stride_kvb + kvh * (D * BLOCK_SIZE)
    if BLOCK_N < BLOCK_SIZE:  # a tile inside one block, from wherever in it n0 falls
        base += first % BLOCK_SIZE
    j = tl.arange(0, SUB)
    off = base[:, None, None] + d[None, :, None] * BLOCK_SIZE + j[None, None, :]
    mask = (first < end)[:, None, None] & dmask[None, :, None]
    runs = tl.load(V_PLANE + off, mask=mask, other=0.0)  # (RUNS, BLOCK_D, SUB)
    return tl.trans(tl.reshape(tl.permute(runs, (1, 0, 2)), (BLOCK_D, BLOCK_N)))


@triton.jit
def _load_v(KV, k_base, stride_kv2, off, kv_mask, table, n0, end, kvh, d, dmask, stride_kvb,
            D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            V_SLOTS_INNER: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) tile of V beside the K tile at ``off`` (keys n0 .. n0 + BLOCK_N, masked
    by ``kv_mask``, or from ``end`` where V is kept slots-innermost), in the cache's layout."""
    if V_SLOTS_INNER:
        v = _load_v_slots_inner(KV + stride_kv2, table, n0, end, kvh, d, dmask, stride_kvb,
                                D, BLOCK_N, BLOCK_D, BLOCK_SIZE)
    else:
        v = tl.load(k_base + stride_kv2 + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return v


# ---------------------------------------------------------------------------- attention: decode


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q, KV, CU, SEQ_LENS, BT, O, MID_O, MID_LSE,
                   stride_qt, stride_qh, stride_kv2, stride_kvb, stride_kvo, stride_kvh,
                   stride_bt, stride_ot, stride_oh, stride_mb, stride_mh, stride_ms,
                   qk_scale, num_splits,
                   HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_FP16: tl.constexpr, V_SLOTS_INNER: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(CU + b)
    is_decode = (tl.load(CU + b + 1) - q_row) == 1  # other sequences are someone else's work
    seq_len = tl.where(is_decode, tl.load(SEQ_LENS + b), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    dmask = d < D
    qmask = ((g < G) & is_decode)[:, None] & dmask[None, :]
    q = tl.load(Q + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=qmask, other=0.0)
    if DOT_FP16:  # K, V and P follow q's dtype below
        q = q.to(tl.float16)

    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    k_base = KV + kvh * stride_kvh
    table = BT + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        off = blk * stride_kvb + (pos % BLOCK_SIZE) * stride_kvo
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), DOT_PREC, UPCAST) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(KV, k_base, stride_kv2, off, kv_mask, table, n0, end, kvh, d, dmask, stride_kvb,
                    D, BLOCK_N, BLOCK_D, BLOCK_SIZE, V_SLOTS_INNER)
        acc = acc * alpha[:, None] + mm(p.to(q.dtype), v.to(q.dtype), DOT_PREC, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DIRECT:
        tl.store(O + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=qmask)
    else:
        # Partial result of this split, with its log2-sum-exp (-inf when the split is empty).
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MID_O + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + d[None, :],
                 out, mask=qmask)
        tl.store(MID_LSE + (b * HQ + heads) * num_splits + split, lse, mask=(g < G) & is_decode)


@triton.jit
def _decode_reduce_kernel(MID_O, MID_LSE, CU, O, stride_mb, stride_mh, stride_ms,
                          stride_ot, stride_oh, num_splits,
                          HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(CU + b)
    is_decode = (tl.load(CU + b + 1) - q_row) == 1
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    smask = (s < num_splits) & is_decode
    dmask = d < D
    lse = tl.load(MID_LSE + (b * HQ + h) * num_splits + s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(smask, tl.exp2(lse - mx), 0.0)
    o = tl.load(MID_O + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + q_row.to(tl.int64) * stride_ot + h * stride_oh + d, res.to(O.dtype.element_ty),
             mask=dmask & is_decode)


def _config(table: dict, dtype: torch.dtype, head_dim: int) -> dict:
    return dict(table[(dtype == torch.float32, head_dim > 128)])


def decode_config_table(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> tuple[dict, object]:
    """(the table, its key) holding the decode kernel's tiles for queries of ``dtype`` over a
    cache of ``cache_dtype`` (None: the queries' dtype)."""
    if fp8_kv.is_fp8(cache_dtype):
        return DECODE_CONFIGS_FP8_CACHE, head_dim > 128
    return DECODE_CONFIGS, (dtype == torch.float32, head_dim > 128)


def _decode_config(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None) -> dict:
    table, key = decode_config_table(dtype, head_dim, cache_dtype)
    return dict(table[key])


def decode_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int,
                      block_n: int = 64) -> int:
    """Splits of each sequence's context so that batch * num_kv_heads * splits programs keep
    ``num_sms`` SMs busy, without splits shorter than MIN_SPLIT_TOKENS (or one tile)."""
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
    useful = triton.cdiv(max(1, max_seqlen_k), max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(wanted, useful, MAX_SPLITS))


def decode_splits_for(batch: int, num_kv_heads: int, max_seqlen_k: int, dtype: torch.dtype,
                      head_dim: int, device: torch.device | str | None = None,
                      cache_dtype: torch.dtype | None = None) -> int:
    """The split count a decode call with these host-side facts uses."""
    if DECODE_SPLITS_OVERRIDE is not None:
        return max(1, int(DECODE_SPLITS_OVERRIDE))
    block_n = _decode_config(dtype, head_dim, cache_dtype)["BLOCK_N"]
    return decode_num_splits(batch, num_kv_heads, max_seqlen_k, get_num_sms(device), block_n)


def _decode(q, kv_cache, meta, qk_scale, out, prec):
    T, HQ, D = q.shape
    HK, BS = kv_cache.shape[3], kv_cache.shape[2]
    G = HQ // HK
    B = meta.seq_lens.shape[0]
    cfg = _decode_config(q.dtype, D, kv_cache.dtype)
    block_n = cfg.pop("BLOCK_N")
    splits = decode_splits_for(B, HK, meta.max_seqlen_k, q.dtype, D, q.device, kv_cache.dtype)
    block_d = triton.next_power_of_2(D)
    g_pad = max(16, triton.next_power_of_2(G))
    tables = meta.block_tables
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    direct = splits == 1
    if direct:
        mid_o, mid_lse = out, out  # unused
        sm = (0, 0, 0)
    else:
        mid_o = _empty((B, HQ, splits, D), torch.float32, q.device)
        mid_lse = _empty((B, HQ, splits), torch.float32, q.device)
        sm = mid_o.stride()[:3]
    _decode_kernel[(B, HK, splits)](
        q, kv_cache, meta.cu_seqlens_q, meta.seq_lens, tables, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), tables.stride(0), out.stride(0), out.stride(1), sm[0], sm[1], sm[2],
        qk_scale, splits, HQ=HQ, G=G, G_PAD=g_pad, D=D, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=BS, DIRECT=direct, DOT_PREC=prec, UPCAST=UPCAST_DOT,
        DOT_FP16=FP8_CACHE_DOT_FP16 and fp8_kv.is_fp8(kv_cache.dtype) and q.dtype != torch.float32,
        V_SLOTS_INNER=fp8_kv.v_slots_inner(kv_cache.dtype), **cfg)
    if not direct:
        _decode_reduce_kernel[(B, HQ)](
            mid_o, mid_lse, meta.cu_seqlens_q, out, sm[0], sm[1], sm[2], out.stride(0),
            out.stride(1), splits, HQ=HQ, D=D, BLOCK_D=block_d,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return splits


# Split counts that between them reach every compiled form of the decode kernels: Triton
# specializes integer arguments equal to 1 or divisible by 16, and SPLITS_PAD is the next
# power of two.
_SPLIT_VARIANTS = (1, 2, 3, 5, 9, 16, 17, 32, 33, 64)


def compile_decode_variants(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            block_size: int, device: torch.device | str,
                            cache_dtype: torch.dtype | None = None) -> None:
    """Compiles every form the decode kernels can take for this head layout, on a scratch
    cache. Which form a step needs depends on its batch, context and SM count, so without
    this the first step of a new form stalls for a compile (most of a second) mid-serving."""
    global DECODE_SPLITS_OVERRIDE
    device = torch.device(device)
    cache = torch.zeros(2, 2, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype, device=device)
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    meta = AttentionMetadata.build([1, 1], [1, 2], [[0], [1]], block_size, device)
    saved = DECODE_SPLITS_OVERRIDE
    try:
        for splits in _SPLIT_VARIANTS:
            DECODE_SPLITS_OVERRIDE = splits
            paged_attention(q, cache, meta, 1.0)
    finally:
        DECODE_SPLITS_OVERRIDE = saved


# ---------------------------------------------------------------------------- attention: prefill


@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(Q, KV, CU, SEQ_LENS, BT, O,
                    stride_qt, stride_qh, stride_kv2, stride_kvb, stride_kvo, stride_kvh,
                    stride_bt, stride_ot, stride_oh, qk_scale, num_seqs,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_B: tl.constexpr, SKIP_SINGLE: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr, V_SLOTS_INNER: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per tile; rows are (token, head) pairs
    kvh = tl.program_id(0)  # fastest grid axis: all heads of the heaviest blocks launch first
    pid = tl.program_id(1)

    # Which sequence and which query block of it this program handles, from cu_seqlens_q.
    sb = tl.arange(0, BLOCK_B)
    bmask = sb < num_seqs
    lo = tl.load(CU + sb, mask=bmask, other=0)
    qlens = tl.load(CU + sb + 1, mask=bmask, other=0) - lo
    nblk = (qlens + TOK - 1) // TOK
    if SKIP_SINGLE:
        nblk = tl.where(qlens > 1, nblk, 0)
    csum = tl.cumsum(nblk, 0)
    seq = tl.sum((csum <= pid).to(tl.int32), 0)
    valid = seq < num_seqs
    sel = sb == seq
    n_seq_blocks = tl.sum(tl.where(sel, nblk, 0), 0)
    # Heaviest (last) query block of each sequence first.
    qblk = tl.sum(tl.where(sel, csum, 0), 0) - 1 - pid
    q_start = tl.sum(tl.where(sel, lo, 0), 0)
    q_len = tl.sum(tl.where(sel, qlens, 0), 0)
    seq_c = tl.minimum(seq, num_seqs - 1)
    seq_len = tl.load(SEQ_LENS + seq_c)
    ctx = seq_len - q_len  # position of the sequence's first new token

    r = tl.arange(0, BLOCK_M)
    tok = qblk * TOK + r // G
    heads = kvh * G + r % G
    rmask = (r < TOK * G) & (tok < q_len) & valid
    q_pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :], mask=qmask, other=0.0)

    first_pos = ctx + qblk * TOK
    last_pos = tl.minimum(first_pos + TOK, seq_len) - 1
    # Keys below full_end are visible to every row of the tile: no mask needed there.
    full_end = tl.where(valid & (n_seq_blocks > 0), ((first_pos + 1) // BLOCK_N) * BLOCK_N, 0)
    kv_end = tl.where(valid & (n_seq_blocks > 0), last_pos + 1, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = KV + kvh * stride_kvh
    table = BT + seq_c.to(tl.int64) * stride_bt
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        blk = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        off = blk * stride_kvb + (pos % BLOCK_SIZE) * stride_kvo
        k = tl.load(k_base + off[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), DOT_PREC, UPCAST) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(KV, k_base, stride_kv2, off, dmask[None, :], table, n0, full_end, kvh, d, dmask, stride_kvb,
                    D, BLOCK_N, BLOCK_D, BLOCK_SIZE, V_SLOTS_INNER)
        acc = acc * alpha[:, None] + mm(p.to(q.dtype), v.to(q.dtype), DOT_PREC, UPCAST)
        m_i = m_new
    for n0 in range(full_end, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        off = blk * stride_kvb + (pos % BLOCK_SIZE) * stride_kvo
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), DOT_PREC, UPCAST) * qk_scale
        s = tl.where((pos[None, :] <= q_pos[:, None]) & nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(KV, k_base, stride_kv2, off, kv_mask, table, n0, kv_end, kvh, d, dmask, stride_kvb,
                    D, BLOCK_N, BLOCK_D, BLOCK_SIZE, V_SLOTS_INNER)
        acc = acc * alpha[:, None] + mm(p.to(q.dtype), v.to(q.dtype), DOT_PREC, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (q_start + tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :], out.to(O.dtype.element_ty), mask=qmask)


def _prefill(q, kv_cache, meta, qk_scale, out, prec, skip_single):
    T, HQ, D = q.shape
    HK, BS = kv_cache.shape[3], kv_cache.shape[2]
    G = HQ // HK
    B = meta.seq_lens.shape[0]
    cfg = _config(PREFILL_CONFIGS, q.dtype, D)
    block_m = max(cfg.pop("BLOCK_M"), triton.next_power_of_2(G))
    block_n = cfg.pop("BLOCK_N")
    tok = block_m // G
    tables = meta.block_tables
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    # Upper bound of sum(ceil(q_len / tok)) from host ints; spare programs find no work.
    grid = (HK, triton.cdiv(T, tok) + B)
    _prefill_kernel[grid](
        q, kv_cache, meta.cu_seqlens_q, meta.seq_lens, tables, out,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), tables.stride(0), out.stride(0), out.stride(1), qk_scale, B,
        G=G, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=BS, BLOCK_B=max(16, triton.next_power_of_2(B)), SKIP_SINGLE=skip_single,
        DOT_PREC=prec, UPCAST=UPCAST_DOT, V_SLOTS_INNER=fp8_kv.v_slots_inner(kv_cache.dtype), **cfg)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of the packed new queries over each sequence's cached context.

    The new tokens' K/V must already be in the cache (write_kv_cache first).
    Returns (T, Hq, D) in q's dtype.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the cache's last dim must be contiguous")
    _check_v_layout(kv_cache, "paged_attention")
    T, HQ, D = q.shape
    HK, BS = kv_cache.shape[3], kv_cache.shape[2]
    if HQ % HK or kv_cache.shape[4] != D:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if BS & (BS - 1):
        raise ValueError(f"paged_attention: block_size {BS} must be a power of two")
    out = _empty((T, HQ, D), q.dtype, q.device)
    B = meta.seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    qk_scale = float(scale) * LOG2E
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if meta.max_seqlen_q <= 1:
        _decode(q, kv_cache, meta, qk_scale, out, prec)
    elif MIXED_DECODE_SPLIT and B > 1:
        _decode(q, kv_cache, meta, qk_scale, out, prec)
        _prefill(q, kv_cache, meta, qk_scale, out, prec, skip_single=True)
    else:
        _prefill(q, kv_cache, meta, qk_scale, out, prec, skip_single=False)
    return out
