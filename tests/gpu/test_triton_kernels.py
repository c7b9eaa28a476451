"""Triton kernels (bullet_trt.kernels.triton_ops) against the torch reference.

On a GPU with Llama-3.1-8B shapes in fp32, bf16 and fp16; without CUDA they are skipped, unless
TRITON_INTERPRET=1 is set (and Triton installed), in which case they run in the Triton
interpreter on CPU with small shapes. Inputs are fresh random tensors; the reference runs in
fp32 on upcast inputs; fresh kernel outputs start as NaN (triton_ops._POISON) and unused KV
slots hold NaN, so an element a kernel forgets to write, or a read past a sequence's context,
fails. Error is relative: ||out - ref|| / ||ref||. Speed: `bullet-trt bench kernels`.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.numerics import CUDA, kernel_device, rel_err

RUNS_IN_TRITON_INTERPRETER = True  # tests/gpu/conftest.py runs this module on CPU then
DEV = kernel_device()  # skips this module where kernels cannot run

from bullet_trt.kernels import fp8_kv  # noqa: E402
from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels import triton_ops as tops  # noqa: E402
from bullet_trt.kernels.metadata import AttentionMetadata  # noqa: E402

BIG = CUDA  # full-size shapes on the GPU, small ones in the interpreter
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 3e-3}
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
# fp16 runs the bf16 code path with another rounding; the interpreter's time is better spent elsewhere
DTYPES = [FP32, BF16, FP16] if BIG else [FP32, BF16]


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    tops._POISON = True
    torch.manual_seed(0)
    yield
    tops._POISON = False
    tops.set_num_sms(None)
    tops.DECODE_SPLITS_OVERRIDE = None
    tops.MIXED_DECODE_SPLIT = True


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, device=DEV) * scale).to(dtype)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"rel_err {err:.3e} > {TOL[dtype]:.0e}"


# -- elementwise ------------------------------------------------------------------------------

# hidden sizes of Llama-8B (4096), Qwen-14B-like (5120) and one that is no power of two; the
# per-head q/k norm of Qwen3 is the (rows * heads, head_dim) case
NORM_SHAPES = ([(r, c) for c in (4096, 5120, 3000) for r in (1, 37, 4096)] + [(33 * 32, 128)] if BIG
               else [(1, 64), (9, 48), (33, 96), (12, 32)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", NORM_SHAPES)
def test_rms_norm(dtype, rows, cols):
    x, w = randn(rows, cols, dtype=dtype, scale=3.0), randn(cols, dtype=dtype)
    check(tops.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_where_they_lie_in_a_fused_projection(dtype):
    """Qwen3's per-head q and k norms over views into one q/k/v row (strides of the fused
    projection, not of the heads), as the model passes them: the same as over a copy."""
    tokens, heads, kv_heads, dim = 7, 4, 2, 32
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, scale=3.0)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    w = randn(dim, dtype=dtype)
    for part, n in ((q, heads), (k, kv_heads)):
        view = part.view(tokens, n, dim)
        assert not view.is_contiguous()
        got = tops.rms_norm(view, w, 1e-6)
        assert got.shape == (tokens, n, dim)
        check(got, ref.rms_norm(view.float(), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", NORM_SHAPES)
def test_add_rms_norm_returns_new_tensors(dtype, rows, cols):
    x, r, w = randn(rows, cols, dtype=dtype), randn(rows, cols, dtype=dtype, scale=4.0), randn(cols, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    normed, summed = tops.add_rms_norm(x, r, w, 1e-5)
    want_n, want_s = ref.add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs were modified"
    check(normed, want_n, dtype)
    check(summed, want_s, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 14336), (37, 14336), (4096, 14336), (3, 1000)] if BIG
                         else [(1, 80), (7, 50), (33, 80)])
def test_silu_and_mul(dtype, rows, inter):
    x = randn(rows, 2 * inter, dtype=dtype, scale=2.0)
    check(tops.silu_and_mul(x), ref.silu_and_mul(x.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 32, 8, 128), (77, 32, 8, 128), (4096, 32, 8, 128), (33, 28, 4, 128),
                                        (19, 16, 2, 64), (11, 12, 4, 96)] if BIG
                         else [(5, 4, 2, 32), (9, 6, 2, 48)])
def test_apply_rope(dtype, T, hq, hkv, d):
    max_pos = 8192 if BIG else 256
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)
    qkv = randn(T, hq + 2 * hkv, d, dtype=dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]  # strided views, as sliced from a fused projection
    pos = torch.randint(0, max_pos, (T,), device=DEV)
    gq, gk = tops.apply_rope(q, k, pos, cs)
    wq, wk = ref.apply_rope(q.float(), k.float(), pos, cs)
    check(gq, wq, dtype)
    check(gk, wk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hkv,d,bs", [(1, 8, 128, 16), (777, 8, 128, 16), (4096, 8, 128, 32), (50, 1, 256, 16)]
                         if BIG else [(13, 2, 32, 16), (20, 2, 48, 32)])
def test_write_kv_cache(dtype, T, hkv, d, bs):
    num_blocks = T // bs + 7
    cache = randn(2, num_blocks, bs, hkv, d, dtype=dtype)
    want = cache.clone()
    slots = torch.randperm(num_blocks * bs)[:T].to(DEV)
    kv = randn(T, 2 * hkv, d, dtype=dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]  # strided views of one tensor, as the engine passes them
    ref.write_kv_cache(k, v, want, slots)
    tops.write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_write_kv_cache_rounds_to_fp8_and_saturates(dtype):
    """kv.cache_dtype=fp8: the kernel stores what the reference stores, byte for byte, values past
    E4M3's 448 clamped to it (a plain cast would make them NaN)."""
    if not CUDA:
        # The interpreter's own float-to-E4M3 conversion rounds values just below a power of two,
        # and subnormals, to other codes than the GPU's and torch's; a CPU serves with the reference.
        pytest.skip("the Triton interpreter's E4M3 rounding is not the GPU's")
    T, hkv, d, bs = (777, 8, 128, 16) if BIG else (13, 2, 32, 16)
    num_blocks = T // bs + 7
    cache = torch.zeros(2, num_blocks, bs, hkv, d, dtype=torch.float8_e4m3fn, device=DEV)
    want = cache.clone()
    slots = torch.randperm(num_blocks * bs)[:T].to(DEV)
    kv = randn(T, 2 * hkv, d, dtype=dtype)
    kv[::3] *= 1000  # every third token far outside E4M3's range
    k, v = kv[:, :hkv], kv[:, hkv:]
    ref.write_kv_cache(k, v, want, slots)
    tops.write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    stored = fp8_kv.standard_layout(cache).float().view(2, -1, hkv, d)[:, slots.long()]
    assert not stored.isnan().any() and stored.abs().max().item() == 448.0
    assert torch.allclose(stored[0, 1::3], k[1::3].float(), rtol=1 / 16, atol=2.0 ** -9)


# -- paged attention --------------------------------------------------------------------------

def attention_case(q_lens, ctx_lens, bs, hq, hkv, d, dtype, capacity=None):
    """Packed queries and a paged cache holding K/V for every position up to ``capacity`` (default
    the context), blocks shuffled; block 0 and unused slots hold NaN."""
    filled = [max(c, capacity or 0, 1) for c in ctx_lens]
    per_seq = [math.ceil(n / bs) for n in filled]
    num_blocks = sum(per_seq) + 2
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(perm[at:at + n])
        at += n
    meta = AttentionMetadata.build(list(q_lens), list(ctx_lens), tables, bs, DEV)
    cache = torch.full((2, num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    slots = []
    for n, table in zip(filled, tables):
        pos = torch.arange(n)
        slots.append(torch.tensor(table, dtype=torch.int64)[pos // bs] * bs + pos % bs)
    slots = torch.cat(slots).to(DEV)
    ref.write_kv_cache(randn(len(slots), hkv, d, dtype=dtype), randn(len(slots), hkv, d, dtype=dtype),
                       cache, slots)
    return randn(sum(q_lens), hq, d, dtype=dtype), cache, meta


def check_attention(q, cache, meta, dtype):
    scale = q.shape[-1] ** -0.5
    got = tops.paged_attention(q, cache, meta, scale)
    want = ref.paged_attention(q.float(), fp8_kv.standard_layout(cache).float(), meta, scale)
    check(got, want, dtype)


H = (32, 8, 128) if BIG else (4, 2, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_attention(dtype, bs, splits):
    tops.DECODE_SPLITS_OVERRIDE = splits
    ctx = [1, bs, bs + 1, 1000, 2047, 77, 500, 4096] if BIG else [1, bs, bs + 1, 70, 33]
    check_attention(*attention_case([1] * len(ctx), ctx, bs, *H, dtype), dtype)


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (28, 4, 128), (16, 2, 64), (8, 1, 256), (12, 4, 96)] if BIG
                         else [(6, 2, 32), (2, 2, 32), (4, 2, 48)])
def test_attention_head_layouts(hq, hkv, d):
    ctx = [1, 300, 999] if BIG else [1, 30, 45]
    check_attention(*attention_case([1] * 3, ctx, 16, hq, hkv, d, BF16), BF16)
    check_attention(*attention_case([1, ctx[1], 1], ctx, 16, hq, hkv, d, BF16), BF16)


def test_decode_follows_set_num_sms():
    tops.set_num_sms(8)
    few = tops.decode_splits_for(1, 8, 4096, BF16, 128)
    tops.set_num_sms(132)
    many = tops.decode_splits_for(1, 8, 4096, BF16, 128)
    assert 1 <= few < many
    ctx = [1000, 3] if BIG else [60, 3]
    check_attention(*attention_case([1, 1], ctx, 16, *H, BF16), BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1000], [1000]), ([513, 17, 1024], [513, 17, 3000]), ([700], [2100])] if BIG else [
    ([37], [37]), ([20, 7, 33], [20, 7, 60]), ([9], [50])])
def test_prefill_attention(dtype, q_lens, ctx_lens):
    check_attention(*attention_case(q_lens, ctx_lens, 16, *H, dtype), dtype)


@pytest.mark.parametrize("q_lens,ctx", [([1] * 6, [1, 16, 17, 70, 33, 300]), ([1, 13, 1, 0, 6, 9], [40, 30, 1, 5, 6, 150])]
                         if not BIG else [([1] * 6, [1, 16, 17, 1000, 2047, 4096]), ([1, 600, 1, 45], [4096, 1800, 333, 45])],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("bs,dtype", [(16, BF16), (32, FP32)])  # fp32's prefill tile (16 keys) inside a block
def test_attention_reads_an_fp8_cache(q_lens, ctx, bs, dtype):
    """kv.cache_dtype=fp8: the kernels read E4M3 K/V into the queries' dtype (exact), so they
    match the reference over the same cache read back in fp32; V kept slots-innermost
    (fp8_kv.py), over tiles of whole blocks, one block's part and past a sequence's end (the
    300-token context, the 150-token one's keys every query sees)."""
    q, cache, meta = attention_case(q_lens, ctx, bs, *H, dtype)
    # an FP8 pool holds no NaN (fp8_kv.py), and its kernels read a block's slots past a sequence's
    # end at zero weight: there they hold E4M3's largest value, which any weight would show
    cache = fp8_kv.from_standard_layout(cache.nan_to_num(448.0), torch.float8_e4m3fn)
    check_attention(q, cache, meta, dtype)


@pytest.mark.parametrize("mixed_split", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_attention(dtype, mixed_split):
    tops.MIXED_DECODE_SPLIT = mixed_split
    if BIG:
        q_lens, ctx = [1, 1, 600, 1, 0, 45, 1], [4096, 1, 1800, 333, 12, 45, 2000]
    else:
        q_lens, ctx = [1, 13, 1, 0, 6, 1], [40, 30, 1, 5, 6, 17]
    check_attention(*attention_case(q_lens, ctx, 16, *H, dtype), dtype)


def _attention_cases() -> list:
    """The wider sweep: batch 1-64, contexts 1-4096 with the block-boundary neighbours, forced
    split counts (1 writes directly, 64 leaves splits empty at short contexts), the split policy
    of a 32-SM partition, chunked prefills over a longer context, mixed batches either way."""
    gen = torch.Generator().manual_seed(1)
    cases = []

    def ctx_for(n, lo, hi, bs):
        special = [lo, hi, bs, bs + 1, 2 * bs - 1, hi - 1] if n > 8 else []
        return [min(hi, max(lo, special[i])) if i < len(special)
                else int(torch.randint(lo, hi + 1, (1,), generator=gen)) for i in range(n)]

    def add(name, q_lens, ctx, bs, hq, hkv, d, dtype, splits=None, num_sms=None, mixed_split=True):
        knobs = "".join([f"-splits{splits}" if splits else "", f"-sms{num_sms}" if num_sms else "",
                         "" if mixed_split else "-prefill_only"])
        case_id = f"{name}-B{len(q_lens)}-T{sum(q_lens)}-ctx{max(ctx)}-bs{bs}-H{hq}.{hkv}.{d}-{str(dtype)[6:]}{knobs}"
        cases.append(pytest.param(q_lens, ctx, bs, (hq, hkv, d), dtype, splits, num_sms, mixed_split, id=case_id))

    if not BIG:
        h = (4, 2, 32)
        for dtype in (FP32, BF16):
            for bs in (16, 32):
                for B in (1, 3, 12):
                    ctx = ctx_for(B, 1, 90, bs)
                    for splits in (None, 1, 3, 8):
                        add("decode", [1] * B, ctx, bs, *h, dtype, splits=splits)
            add("chunked", [20, 9], [50, 9], 16, *h, dtype)
            add("mixed", [2, 1], [9, 70], 16, *h, dtype, splits=4)
            add("decode", [1, 1], [70, 3], 16, *h, dtype, num_sms=1)
        return cases

    l8b = (32, 8, 128)
    for bs in (16, 32):
        for B in (1, 3, 17, 64):
            ctx = ctx_for(B, 1, 4096, bs)
            add("decode", [1] * B, ctx, bs, *l8b, BF16)
            if bs == 16:
                for splits in (1, 7, 64):
                    add("decode", [1] * B, ctx, bs, *l8b, BF16, splits=splits)
                add("decode", [1] * B, ctx, bs, *l8b, BF16, num_sms=32)
        for B in (1, 5, 17):
            add("decode", [1] * B, ctx_for(B, 1, 2048, bs), bs, *l8b, FP32)
        add("prefill", [4096], [4096], bs, *l8b, BF16)
    add("prefill", [1000, 17, 513, 2048], [1000, 17, 513, 2048], 16, *l8b, BF16)
    add("chunked", [512, 1024, 33], [2000, 1024, 4000], 16, *l8b, BF16)
    add("chunked", [2048], [4096], 32, *l8b, BF16)
    mixed_q = [1] * 40 + [300, 77, 1200, 0, 2]
    mixed_c = ctx_for(40, 1, 4096, 16) + [2300, 77, 3000, 11, 4096]
    for mixed_split in (True, False):
        add("mixed", mixed_q, mixed_c, 16, *l8b, BF16, mixed_split=mixed_split)
    add("mixed", [1, 1, 700, 1], [4096, 1, 1500, 333], 32, *l8b, BF16, splits=16)
    add("prefill", [700], [700], 16, *l8b, FP32)
    add("chunked", [300, 1], [1000, 50], 16, *l8b, FP32)
    add("mixed", [1, 250, 1, 3], [999, 260, 4096, 3], 32, *l8b, FP32)
    for hq, hkv, d in ((8, 8, 128), (28, 4, 128), (16, 2, 64), (8, 1, 256), (12, 4, 96)):
        add("decode", [1] * 5, ctx_for(5, 1, 3000, 16), 16, hq, hkv, d, BF16)
        add("mixed", [1, 400, 1, 37], [2000, 900, 17, 37], 16, hq, hkv, d, BF16)
    add("mixed", [1, 400, 1, 37], [2000, 900, 17, 37], 16, 8, 1, 256, FP32)
    add("decode", [1] * 17, ctx_for(17, 1, 4096, 16), 16, *l8b, FP16)
    add("mixed", [1, 1, 700, 1], [4096, 1, 1500, 333], 16, *l8b, FP16)
    return cases


@pytest.mark.parametrize("q_lens,ctx_lens,bs,heads,dtype,splits,num_sms,mixed_split", _attention_cases())
def test_paged_attention_cases(q_lens, ctx_lens, bs, heads, dtype, splits, num_sms, mixed_split):
    tops.set_num_sms(num_sms)
    tops.DECODE_SPLITS_OVERRIDE = splits
    tops.MIXED_DECODE_SPLIT = mixed_split
    check_attention(*attention_case(q_lens, ctx_lens, bs, *heads, dtype), dtype)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replays_with_new_seq_lens():
    """Captured once at the longest context, as the engine captures; the token ranges come
    from seq_lens on the device at every replay, so growing contexts need no new graph."""
    B, bs, cap = 6, 16, 2048
    q, cache, meta = attention_case([1] * B, [cap] * B, bs, *H, BF16, capacity=cap)
    meta.seq_lens.copy_(torch.tensor([5, 100, 1000, 17, 2000, 64], dtype=torch.int32))
    meta.max_seqlen_k = cap
    scale = H[2] ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tops.paged_attention(q, cache, meta, scale)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tops.paged_attention(q, cache, meta, scale)
    for lens in ([5, 100, 1000, 17, 2000, 64], [2048, 1, 1500, 33, 2047, 700], [cap] * B):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(out, ref.paged_attention(q.float(), cache.float(), meta, scale), BF16)
