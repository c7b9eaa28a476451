"""Fused mixture-of-experts on GPUs: ``moe_route`` and ``fused_moe`` with the signatures of
``reference.py``, re-exported by ``triton_ops`` (imported only on CUDA, like it).

``fused_moe`` is a grouped GEMM over the token-expert assignments sorted by expert, in the
manner of vLLM's fused_moe:

1. ``moe_align_block_size`` groups the T * k assignment ids by expert and pads each expert's
   run to a multiple of BLOCK_M, so every block of BLOCK_M sorted rows belongs to one expert;
   it returns the padded sorted ids (padding holds T * k, an id no assignment has), the expert
   of each block, and the padded length, all on the device.
2. One kernel multiplies each block's rows of x by its expert's gate and up rows at once (two
   accumulators over the same A tile) and writes silu(gate) * up, one row per assignment.
3. A second kernel multiplies those rows by the expert's down projection and by the
   assignment's routing weight; the k rows of a token are then summed in fp32.

Nothing reads a device value on the host: buffers and grids are sized for the worst case,
T * k + E * (BLOCK_M - 1) sorted rows, from host ints alone (T, k, E and the tile), and blocks
past the padded length return at once. The decode step's CUDA graph therefore captures it as
it is, and the same graph serves any routing.

Expert parallelism's seam: the weights may hold only the experts ``expert_offset`` ..
``expert_offset + E_local - 1``; assignments to other experts are left out of the sort and
add nothing, so ranks holding disjoint ranges sum their outputs (docs/moe.md).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from bullet_trt.kernels import fp8_blocks, moe_tiles
from bullet_trt.kernels.triton_route import moe_route
from bullet_trt.kernels.sm_budget import get_num_sms, whole_device_sms
from bullet_trt.kernels.triton_dot import UPCAST_DOT, mm

__all__ = ["moe_route", "fused_moe", "moe_align_block_size", "moe_config", "untuned_config", "tuned_tables",
           "compile_moe_variants"]

# The untuned tiles, keyed by (fp32 inputs, large), for a GPU or layer shape without a tuned
# table (moe_tiles.py). "large" is for batches whose experts see LARGE_ROWS_PER_EXPERT rows
# each on average (prefill); the small tiles are for decode, where an expert sees a few rows and
# the kernel's time is reading its weights. fp32 exists for tests, not speed. On an H100 with
# Qwen3-30B-A3B's layer (docs/moe.md): the small tiles read the routed experts at 89-90% of the
# copy bandwidth from 32 to 64 decode rows; the large ones reach 302 TFLOP/s of routed GEMMs at
# 8192 prefill tokens. Between the two (a few hundred decode rows) neither is right: that is
# what the tuned tables are for.
MOE_CONFIGS = {
    (False, False): dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    (False, True): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    (True, False): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2),
    (True, True): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
LARGE_ROWS_PER_EXPERT = 32
# FP8 activations' large form: a K step of 128 is one scale group of the experts' blocks and of
# x's token groups, scaled once per step; with the bf16 form's K step of 64 a 768-4096-token
# layer of Qwen3-30B-A3B ran 2.6-3.7x slower on an H200 than with this tile, its table's best
# from 512 tokens up (2026-11-28, docs/moe.md).
FP8_ACTIVATIONS_LARGE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
# Forces this tile for every call when set: the tests (both forms), the tuner and the warm-up.
MOE_TILE_OVERRIDE: dict | None = None


# cached whole: every eager MoE layer asks, and the name, device query and file lookups behind
# the answer do not change while the process runs
@functools.lru_cache(maxsize=None)
def tuned_tables(dtype: torch.dtype, top_k: int, num_local_experts: int, inter: int, hidden: int,
                 device: torch.device, fp8_activations: bool = False) -> dict[int | None, tuple[tuple[int, dict], ...]]:
    """This GPU's tuned tile tables for the layer shape and weight dtype (and FP8 activations),
    by the SM count each was tuned on (None: the whole GPU); none for fp32, which is never tuned."""
    if device.type != "cuda" or dtype == torch.float32:
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    names = moe_tiles.tables_of(torch.cuda.get_device_name(index), num_local_experts, inter, hidden, top_k,
                                moe_tiles.dtype_label(str(dtype).removeprefix("torch."), fp8_activations))
    return {sms: moe_tiles.load_table(name) for sms, name in names.items()}


def untuned_forms(dtype: torch.dtype, fp8_activations: bool = False) -> tuple[dict, dict]:
    """The (small, large) tiles a call of x in ``dtype`` takes without a table."""
    small, large = (dict(MOE_CONFIGS[(dtype == torch.float32, big)]) for big in (False, True))
    return small, dict(FP8_ACTIVATIONS_LARGE) if fp8_activations else large


def untuned_config(dtype: torch.dtype, tokens: int, top_k: int, num_local_experts: int,
                   fp8_activations: bool = False) -> dict:
    large = tokens * top_k >= LARGE_ROWS_PER_EXPERT * num_local_experts
    return untuned_forms(dtype, fp8_activations)[large]


def moe_config(dtype: torch.dtype, tokens: int, top_k: int, num_local_experts: int, inter: int,
               hidden: int, device: torch.device, weight_dtype: torch.dtype | None = None,
               fp8_activations: bool = False) -> dict:
    """The tile for ``tokens`` rows of x (``dtype``) routed to ``top_k`` of ``num_local_experts``
    experts of this shape, whose weights are ``weight_dtype`` (x's by default), x rounded to FP8
    with ``fp8_activations``: the override, else the tuned table's, else the untuned form's."""
    if MOE_TILE_OVERRIDE is not None:
        return dict(MOE_TILE_OVERRIDE)
    tables = tuned_tables(weight_dtype or dtype, top_k, num_local_experts, inter, hidden, device, fp8_activations)
    if tables:
        table = moe_tiles.table_for(tables, get_num_sms(device), whole_device_sms(device), tokens)
        return moe_tiles.tile_for(table, tokens)
    return untuned_config(dtype, tokens, top_k, num_local_experts, fp8_activations)


# Assignments one program of the alignment kernels handles per step.
ALIGN_CHUNK = 1024


@triton.jit(do_not_specialize=["n"])
def _moe_count_kernel(IDS, CURSOR, END, NUM_PADDED, n, expert_offset, E: tl.constexpr,
                      E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each local expert's assignments, padded to BLOCK_M; CURSOR gets where
    each expert's run starts, END where it ends, NUM_PADDED the padded length."""
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ex = tl.load(IDS + offs, mask=offs < n, other=-1) - expert_offset
        # other ranks' experts and the tail beyond n land in the spare last bin
        counts += tl.histogram(tl.where((ex >= 0) & (ex < E) & (offs < n), ex, E_PAD - 1), E_PAD)
    e = tl.arange(0, E_PAD)
    padded = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    end = tl.cumsum(padded, 0)
    tl.store(CURSOR + e, end - padded, mask=e < E)
    tl.store(END + e, end, mask=e < E)
    tl.store(NUM_PADDED, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["n", "length"])
def _moe_blocks_kernel(SORTED, BLOCK_EXPERT, END, n, length, E: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Fills a chunk of the sorted ids with the padding id n, and gives each of its blocks
    its expert: how many experts' runs end at or before the block's start (E past the end)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(SORTED + offs, tl.zeros([CHUNK], tl.int32) + n, mask=offs < length)
    blocks = tl.program_id(0) * (CHUNK // BLOCK_M) + tl.arange(0, CHUNK // BLOCK_M)
    e = tl.arange(0, E_PAD)
    end = tl.load(END + e, mask=e < E, other=2147483647)
    expert = tl.sum((end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(BLOCK_EXPERT + blocks, expert, mask=blocks * BLOCK_M < length)


@triton.jit(do_not_specialize=["n"])
def _moe_scatter_kernel(IDS, SORTED, CURSOR, n, expert_offset, E: tl.constexpr, CHUNK: tl.constexpr):
    """Each local assignment takes the next free row of its expert's run. Rows within a run
    come in no fixed order, which changes nothing: every row is computed on its own."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ex = tl.load(IDS + offs, mask=offs < n, other=-1) - expert_offset
    local = (ex >= 0) & (ex < E) & (offs < n)
    dest = tl.atomic_add(CURSOR + tl.where(local, ex, 0), 1, mask=local)
    tl.store(SORTED + dest, offs, mask=local)


def _int32_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """The assignments as the kernels index them: contiguous int32 (a view when they are)."""
    if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous():
        return topk_ids
    return topk_ids.to(torch.int32).contiguous()


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_local_experts: int,
                         expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted assignment ids int32 (L,), expert of each BLOCK_M block int32 (L / block_m,),
    padded length int32 (1,)) for the assignments ``topk_ids`` (T, k), with
    L = round_up(T * k + E_local * (block_m - 1), block_m), the most any routing can need.

    Assignment id i is token i // k's slot i % k. Each local expert's ids lie in one run of
    whole blocks, padded with T * k; blocks past the padded length have expert E_local.
    Assignments outside this rank's experts are left out. Three kernels (count and pad, fill
    and label the blocks, scatter), sized from host ints alone: torch ops for the same work
    were some thirty launches, which bound eager (prefill) steps by the host's launch rate."""
    device = topk_ids.device
    ids = _int32_ids(topk_ids).reshape(-1)
    n, e_local = ids.numel(), num_local_experts
    length = triton.cdiv(n + e_local * (block_m - 1), block_m) * block_m
    chunk = max(ALIGN_CHUNK, block_m)
    e_pad = triton.next_power_of_2(e_local + 1)  # a spare bin for other ranks' experts
    # one allocation: sorted ids, block experts, cursors, run ends, the padded length
    work = torch.empty(length + length // block_m + 2 * e_local + 1, dtype=torch.int32, device=device)
    sorted_ids, block_expert, cursor, end, num_padded = work.split(
        [length, length // block_m, e_local, e_local, 1])
    _moe_count_kernel[(1,)](ids, cursor, end, num_padded, n, expert_offset, E=e_local, E_PAD=e_pad,
                            BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    _moe_blocks_kernel[(triton.cdiv(length, chunk),)](sorted_ids, block_expert, end, n, length, E=e_local,
                                                       E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    _moe_scatter_kernel[(triton.cdiv(n, chunk),)](ids, sorted_ids, cursor, n, expert_offset, E=e_local,
                                                  CHUNK=chunk, num_warps=4)
    return sorted_ids, block_expert, num_padded


@triton.jit
def _product(a, b, SWAP_AB: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One step's tile product: a @ b, or with SWAP_AB, where the tiles were loaded transposed
    (a^T, b^T), b^T @ a^T, the weights then being the dot's first operand."""
    if SWAP_AB:
        c = mm(b, a, PREC, UPCAST)
    else:
        c = mm(a, b, PREC, UPCAST)
    return c


@triton.jit
def _scaled_product(a, b, s, a_s, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr, ONE_SCALE: tl.constexpr):
    """_product of FP8 weights ``b``, each column scaled by ``s``: converted to a's dtype, or with
    A_FP8, where ``a`` is FP8 too, multiplied as they are (the tensor cores' FP8 rate) and each
    row scaled by ``a_s``. ONE_SCALE: ``s`` is one value for the whole tile, folded into the
    rows' scales, so the tile is multiplied once."""
    if A_FP8:
        c = _product(a, b, SWAP_AB, PREC, UPCAST)
    else:
        c = _product(a, b.to(a.dtype), SWAP_AB, PREC, UPCAST)
    if ONE_SCALE:
        if not A_FP8:
            c = c * s
        elif SWAP_AB:
            c = c * (a_s * s)[None, :]
        else:
            c = c * (a_s * s)[:, None]
    elif SWAP_AB:
        c = c * s[:, None]
        if A_FP8:
            c = c * a_s[None, :]
    else:
        c = c * s[None, :]
        if A_FP8:
            c = c * a_s[:, None]
    return c


# Rows per program of the activations' rounding: one group's 128 columns of one row are 256 bytes,
# too little for a program to cover its launch and its reduction; 16 rows a program read 4 KiB.
QUANTIZE_ROWS = 16


# cols stays specialized: a model has two widths, and only Triton's hint that they divide by 16
# lets the column mask vectorize; without it every thread moved 2 bytes a load (0.2-0.8 TB/s).
@triton.jit(do_not_specialize=["rows"])
def _quantize_token_groups_kernel(X, Q, S, rows, cols, stride_x, stride_q, stride_s,
                                  ROWS: tl.constexpr, GROUP: tl.constexpr):
    """ROWS rows' one group of GROUP columns to FP8, with a scale per row (fp8_blocks.quantize_token_groups)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    row_ok = r < rows
    mask = row_ok[:, None] & (offs < cols)[None, :]
    r = r.to(tl.int64)
    x = tl.load(X + r[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    tl.store(Q + r[:, None] * stride_q + offs[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r * stride_s + tl.program_id(1), scale, mask=row_ok)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_blocks.quantize_token_groups on the device, without a host sync (graph-safe). In
    Triton's interpreter (UPCAST_DOT) torch's instead: the interpreter rounds fp32 to FP8 wrongly
    just below a power of two (31.6 to 16), which a GPU's conversion does not."""
    if UPCAST_DOT:
        return fp8_blocks.quantize_token_groups(x)
    rows, cols = x.shape
    groups = triton.cdiv(cols, fp8_blocks.BLOCK)
    q = torch.empty(rows, cols, dtype=fp8_blocks.FP8, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, QUANTIZE_ROWS), groups)
        _quantize_token_groups_kernel[grid](x, q, scale, rows, cols, x.stride(0), q.stride(0), scale.stride(0),
                                            ROWS=QUANTIZE_ROWS, GROUP=fp8_blocks.BLOCK, num_warps=4)
    return q, scale


# A program of the sum: 8 tokens' 256 columns, each of their k rows a 4 KiB load
SUM_TOKENS, SUM_COLUMNS = 8, 256


@triton.jit(do_not_specialize=["T", "expert_offset"])
def _moe_sum_kernel(Y, IDS, OUT, T, H, expert_offset, E: tl.constexpr, K: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT[t] = the sum of Y[t * K + j] over the token's K assignments to local experts, in
    fp32: the rows of other ranks' experts and of NO_EXPERT were never written, and are not read."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok, h_ok = t < T, h < H
    t = t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        ex = tl.load(IDS + t * K + j, mask=t_ok, other=-1) - expert_offset
        local = (ex >= 0) & (ex < E) & t_ok
        y = tl.load(Y + (t * K + j)[:, None] * H + h[None, :], mask=local[:, None] & h_ok[None, :], other=0.0)
        acc += y.to(tl.float32)
    tl.store(OUT + t[:, None] * H + h[None, :], acc.to(OUT.dtype.element_ty), mask=t_ok[:, None] & h_ok[None, :])


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int) -> torch.Tensor:
    """(T, H): each token's rows of y (T * k, H) summed over its assignments to the local
    experts; one pass, where zeroing y first and summing all k rows took three."""
    T, k = topk_ids.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    grid = (triton.cdiv(T, SUM_TOKENS), triton.cdiv(H, SUM_COLUMNS))
    _moe_sum_kernel[grid](y, _int32_ids(topk_ids), out, T, H, expert_offset, E=num_local_experts, K=k, BLOCK_T=SUM_TOKENS,
                          BLOCK_H=SUM_COLUMNS, num_warps=4)
    return out


# num_valid and num_rows change with the batch: kept out of Triton's specialization so that a
# new batch size compiles nothing (see triton_ops on specialization).
@triton.jit(do_not_specialize=["num_valid", "num_rows"])
def _moe_gemm_kernel(A, B, C, W, S, AS, SORTED, BLOCK_EXPERT, NUM_PADDED,
                     N, K, num_valid, num_rows, stride_am, stride_be, stride_bn, stride_cm,
                     stride_se, stride_sn, stride_asm,
                     A_ROWS_PER_ID: tl.constexpr, GATE_UP: tl.constexpr, WEIGHTED: tl.constexpr,
                     FP8_BLOCK: tl.constexpr, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                     ONE_SCALE: tl.constexpr):
    """C[id] = A[id // A_ROWS_PER_ID] @ B[expert]^T for the sorted ids of one block: with
    GATE_UP, B's rows n and N + n are gate and up and C gets silu(gate) * up; with WEIGHTED,
    C is scaled by W[id]. Last dims are contiguous. FP8_BLOCK > 0: B is FP8 with a float32
    scale S per FP8_BLOCK x FP8_BLOCK block (fp8_blocks.py; the up's scale rows follow the
    gate's); each BLOCK_K step lies in one block (BLOCK_K divides FP8_BLOCK), so its product
    is scaled per column once. A_FP8: A is FP8 too, with a scale AS per row and FP8_BLOCK
    columns (its activations rounded per token). SWAP_AB computes C^T = B A^T: the weights,
    which FP8 converts in registers, become the dot's first operand (Hopper's wgmma reads that
    one from registers, the second only from shared memory), and a block's few rows its narrow
    side. ONE_SCALE: the tile's BLOCK_N columns lie in one scale block (BLOCK_N divides
    FP8_BLOCK), so each K step loads one weight scale, not a vector of BLOCK_N equal ones held
    in registers."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row blocks walk the column blocks together, so a weight tile read by
    # one block of an expert is still in L2 for the expert's next block
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return

    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SORTED + offs)
    valid = ids < num_valid
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    rows = (ids // A_ROWS_PER_ID).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    k = tl.arange(0, BLOCK_K)
    if SWAP_AB:  # the tiles transposed: A^T (BLOCK_K, BLOCK_M), B (BLOCK_N, BLOCK_K)
        a_ptrs = A + rows[None, :] * stride_am + k[:, None]
        b_ptrs = B + expert * stride_be + cols.to(tl.int64)[:, None] * stride_bn + k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_ptrs = A + rows[:, None] * stride_am + k[None, :]
        b_ptrs = B + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bn + k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8_BLOCK:
        if ONE_SCALE:
            s_ptrs = S + expert * stride_se + (pid_n * BLOCK_N // FP8_BLOCK) * stride_sn
        else:
            s_ptrs = S + expert * stride_se + (cols // FP8_BLOCK) * stride_sn
        # the up's scale rows start after the gate's ceil(N / FP8_BLOCK)
        s_up_ptrs = s_ptrs + tl.cdiv(N, FP8_BLOCK) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        kmask = k < K - k0
        if SWAP_AB:
            a = tl.load(a_ptrs, mask=kmask[:, None] & valid[None, :], other=0.0)
            b_mask = cmask[:, None] & kmask[None, :]
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            b_mask = kmask[:, None] & cmask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if FP8_BLOCK:
            if ONE_SCALE:
                s = tl.load(s_ptrs + k0 // FP8_BLOCK)
            else:
                s = tl.load(s_ptrs + k0 // FP8_BLOCK, mask=cmask, other=0.0)
            if A_FP8:
                a_s = tl.load(AS + rows * stride_asm + k0 // FP8_BLOCK, mask=valid, other=0.0)
            else:
                a_s = s  # not read
            acc += _scaled_product(a, b, s, a_s, A_FP8, SWAP_AB, DOT_PREC, UPCAST, ONE_SCALE)
        else:
            acc += _product(a, b, SWAP_AB, DOT_PREC, UPCAST)
        if GATE_UP:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            if FP8_BLOCK:
                if ONE_SCALE:
                    s_up = tl.load(s_up_ptrs + k0 // FP8_BLOCK)
                else:
                    s_up = tl.load(s_up_ptrs + k0 // FP8_BLOCK, mask=cmask, other=0.0)
                acc_up += _scaled_product(a, b_up, s_up, a_s, A_FP8, SWAP_AB, DOT_PREC, UPCAST, ONE_SCALE)
            else:
                acc_up += _product(a, b_up, SWAP_AB, DOT_PREC, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SWAP_AB:
        acc = tl.trans(acc)
    if WEIGHTED:
        acc = acc * tl.load(W + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(C + ids.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=valid[:, None] & cmask[None, :])


def _gemm(a, b, c, weights, scales, sorted_ids, block_expert, num_padded, num_valid, a_rows_per_id,
          gate_up, cfg, prec, a_scales=None):
    cfg = dict(cfg)
    bm, bn, bk, gm = (cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    swap_ab = bool(cfg.pop("SWAP_AB", 0))
    n = b.shape[1] // 2 if gate_up else b.shape[1]
    num_rows = sorted_ids.shape[0]
    grid = (triton.cdiv(num_rows, bm) * triton.cdiv(n, bn),)
    fp8_block = fp8_blocks.BLOCK if scales is not None else 0
    if fp8_block and fp8_block % bk:
        raise ValueError(f"fused_moe: BLOCK_K {bk} must divide the FP8 scale block {fp8_block}")
    s = scales if scales is not None else b  # never read without FP8_BLOCK
    a_s = a_scales if a_scales is not None else s  # never read without A_FP8
    _moe_gemm_kernel[grid](
        a, b, c, weights, s, a_s, sorted_ids, block_expert, num_padded, n, b.shape[2], num_valid, num_rows,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), s.stride(0), s.stride(1), a_s.stride(0),
        A_ROWS_PER_ID=a_rows_per_id, GATE_UP=gate_up, WEIGHTED=weights is not None and not gate_up,
        FP8_BLOCK=fp8_block, A_FP8=a_scales is not None, SWAP_AB=swap_ab, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=gm, DOT_PREC=prec, UPCAST=UPCAST_DOT, ONE_SCALE=bool(fp8_block) and fp8_block % bn == 0, **cfg)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_offset: int = 0, gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None, fp8_activations: bool = False) -> torch.Tensor:
    """Sum over each token's k experts of weight * down(silu(gate(x)) * up(x)); shapes, the
    expert range, the FP8 weights' scales and FP8 activations as in ``reference.fused_moe``."""
    T, H = x.shape
    e_local, two_inter, h_in = w_gate_up.shape
    inter = two_inter // 2
    k = topk_ids.shape[1]
    if (h_in != H or two_inter % 2 or w_down.shape != (e_local, H, inter)
            or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != T):
        raise ValueError(f"fused_moe: x {tuple(x.shape)} w_gate_up {tuple(w_gate_up.shape)} "
                         f"w_down {tuple(w_down.shape)} topk {tuple(topk_ids.shape)} do not fit")
    if T == 0 or e_local == 0:
        return torch.zeros_like(x)
    x, w_gate_up, w_down = _contiguous(x), _contiguous(w_gate_up), _contiguous(w_down)
    weights = _contiguous(topk_weights).reshape(-1)
    topk_ids = _int32_ids(topk_ids)  # once, for the alignment and the sum
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("fused_moe: FP8 experts need both gate_up_scale and down_scale")
    if fp8_activations and gate_up_scale is None:
        raise ValueError("fused_moe: FP8 activations go with FP8 weights (gate_up_scale, down_scale)")
    if gate_up_scale is not None:
        gate_up_scale, down_scale = _contiguous(gate_up_scale), _contiguous(down_scale)
    cfg = moe_config(x.dtype, T, k, e_local, inter, H, x.device, w_gate_up.dtype, fp8_activations)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e_local,
                                                                expert_offset)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    # rows of assignments to other ranks' experts (and to NO_EXPERT) are never written: moe_sum skips them
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    # with FP8 activations each product's input is rounded per token and 128 columns as the step runs
    a, a_scale = quantize_token_groups(x) if fp8_activations else (x, None)
    _gemm(a, w_gate_up, act, None, gate_up_scale, sorted_ids, block_expert, num_padded, T * k, k, True,
          cfg, prec, a_scale)
    a, a_scale = quantize_token_groups(act) if fp8_activations else (act, None)
    _gemm(a, w_down, y, weights, down_scale, sorted_ids, block_expert, num_padded, T * k, 1, False,
          cfg, prec, a_scale)
    return moe_sum(y, topk_ids, e_local, expert_offset)


def compile_moe_variants(num_local_experts: int, hidden: int, inter: int, top_k: int,
                         dtype: torch.dtype, device: torch.device | str, fp8_experts: bool = False,
                         fp8_activations: bool = False) -> None:
    """Compiles every tile this layer shape can take (its tuned tables', else both untuned
    forms): which one a step takes depends on its token count, and without this the first large
    prefill would stall for a compile (most of a second) mid-serving. The GEMMs' compiled form
    depends on the shapes, top_k and dtype but not on the expert count, so one scratch expert
    stands in for all of them; the alignment kernels' depends on it, so they run for the real
    count."""
    global MOE_TILE_OVERRIDE
    device = torch.device(device)
    weight_dtype = fp8_blocks.FP8 if fp8_experts else dtype
    tables = tuned_tables(weight_dtype, top_k, num_local_experts, inter, hidden, device, fp8_activations)
    if tables:  # every partition's: a worker moves between them
        tiles = [tile for table in tables.values() for _, tile in table]
    else:
        tiles = list(untuned_forms(dtype, fp8_activations))
    x = torch.zeros(2, hidden, dtype=dtype, device=device)
    w_gate_up = torch.zeros(1, 2 * inter, hidden, dtype=dtype, device=device)
    w_down = torch.zeros(1, hidden, inter, dtype=dtype, device=device)
    scales = {"fp8_activations": True} if fp8_activations else {}
    if fp8_experts:
        fp8 = fp8_blocks.quantize_experts(w_gate_up, w_down)
        w_gate_up, w_down = fp8.pop("w_gate_up"), fp8.pop("w_down")
        scales.update(fp8)
    ids = torch.zeros(2, top_k, dtype=torch.int32, device=device)
    weights = torch.ones(2, top_k, dtype=dtype, device=device)
    saved = MOE_TILE_OVERRIDE
    try:
        for tile in {tuple(sorted(t.items())): t for t in tiles}.values():
            MOE_TILE_OVERRIDE = tile
            fused_moe(x, w_gate_up, w_down, weights, ids, **scales)
            moe_align_block_size(ids, tile["BLOCK_M"], num_local_experts)
    finally:
        MOE_TILE_OVERRIDE = saved
