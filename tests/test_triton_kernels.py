"""Triton kernels (bullet_trt.kernels.triton_ops) against the torch reference.

Marked ``gpu``: they run on a GPU machine. Without CUDA they are skipped, unless TRITON_INTERPRET=1
is set (and Triton installed), in which case they run in the Triton interpreter on CPU with
small shapes. Outputs are compared with the reference computed in fp32 on upcast inputs, by
relative error ||out - ref|| / ||ref||.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not (CUDA or INTERPRET):
    pytest.skip("Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels import triton_ops as tops  # noqa: E402
from bullet_trt.kernels.metadata import AttentionMetadata  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda" if CUDA else "cpu")
BIG = CUDA  # full-size shapes on the GPU, small ones in the interpreter
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.float(), want.float()
    assert out.shape == want.shape
    assert torch.isfinite(out).all(), "output holds NaN/inf (unwritten or read past the context)"
    return ((out - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Fresh kernel outputs start as NaN, so an element a kernel forgets to write fails."""
    tops._POISON = True
    torch.manual_seed(0)
    yield
    tops._POISON = False
    tops.set_num_sms(None)
    tops.DECODE_SPLITS_OVERRIDE = None
    tops.MIXED_DECODE_SPLIT = True


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 4096), (37, 4096), (33 * 32, 128)] if BIG else [(1, 64), (9, 48)])
def test_rms_norm(dtype, rows, cols):
    x, w = randn(rows, cols, dtype=dtype, scale=3.0), randn(cols, dtype=dtype)
    assert rel_err(tops.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 4096), (300, 5120)] if BIG else [(1, 64), (9, 40)])
def test_add_rms_norm_returns_new_tensors(dtype, rows, cols):
    x, r, w = randn(rows, cols, dtype=dtype), randn(rows, cols, dtype=dtype, scale=4.0), randn(cols, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    normed, summed = tops.add_rms_norm(x, r, w, 1e-5)
    want_n, want_s = ref.add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs were modified"
    assert rel_err(normed, want_n) <= TOL[dtype]
    assert rel_err(summed, want_s) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 14336), (65, 14336), (3, 1000)] if BIG else [(1, 80), (7, 50)])
def test_silu_and_mul(dtype, rows, inter):
    x = randn(rows, 2 * inter, dtype=dtype, scale=2.0)
    assert rel_err(tops.silu_and_mul(x), ref.silu_and_mul(x.float())) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 32, 8, 128), (513, 32, 8, 128), (7, 12, 4, 96)] if BIG
                         else [(5, 4, 2, 32), (3, 6, 2, 48)])
def test_apply_rope(dtype, T, hq, hkv, d):
    max_pos = 4096
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)
    qkv = randn(T, hq + 2 * hkv, d, dtype=dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]  # strided views, as sliced from a fused projection
    pos = torch.randint(0, max_pos, (T,), device=DEV)
    gq, gk = tops.apply_rope(q, k, pos, cs)
    wq, wk = ref.apply_rope(q.float(), k.float(), pos, cs)
    assert rel_err(gq, wq) <= TOL[dtype]
    assert rel_err(gk, wk) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 32])
def test_write_kv_cache(dtype, bs):
    T, hkv, d = (777, 8, 128) if BIG else (13, 2, 32)
    num_blocks = T // bs + 5
    cache = randn(2, num_blocks, bs, hkv, d, dtype=dtype)
    want = cache.clone()
    slots = torch.randperm(num_blocks * bs)[:T].to(DEV)
    k, v = randn(T, hkv, d, dtype=dtype), randn(T, hkv, d, dtype=dtype)
    ref.write_kv_cache(k, v, want, slots)
    tops.write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, want)


def attention_case(q_lens, ctx_lens, bs, hq, hkv, d, dtype, capacity=None):
    """Packed queries and a paged cache holding K/V for every position up to ``capacity`` (default
    the context), blocks shuffled; block 0 and unused slots hold NaN."""
    filled = [max(c, capacity or 0) for c in ctx_lens]
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
    want = ref.paged_attention(q.float(), cache.float(), meta, scale)
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"rel_err {err:.3e}"


H = (32, 8, 128) if BIG else (4, 2, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_attention(dtype, bs, splits):
    tops.DECODE_SPLITS_OVERRIDE = splits
    ctx = [1, bs, bs + 1, 1000, 2047, 77, 500, 4096] if BIG else [1, bs, bs + 1, 70, 33]
    check_attention(*attention_case([1] * len(ctx), ctx, bs, *H, dtype), dtype)


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (28, 4, 128), (8, 1, 256), (12, 4, 96)] if BIG
                         else [(6, 2, 32), (2, 2, 32), (4, 2, 48)])
def test_attention_head_layouts(hq, hkv, d):
    ctx = [1, 300, 999] if BIG else [1, 30, 45]
    check_attention(*attention_case([1] * 3, ctx, 16, hq, hkv, d, torch.bfloat16), torch.bfloat16)
    check_attention(*attention_case([1, ctx[1], 1], ctx, 16, hq, hkv, d, torch.bfloat16), torch.bfloat16)


def test_decode_follows_set_num_sms():
    tops.set_num_sms(8)
    few = tops.decode_splits_for(1, 8, 4096, torch.bfloat16, 128)
    tops.set_num_sms(132)
    many = tops.decode_splits_for(1, 8, 4096, torch.bfloat16, 128)
    assert 1 <= few < many
    ctx = [1000, 3] if BIG else [60, 3]
    check_attention(*attention_case([1, 1], ctx, 16, *H, torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1000], [1000]), ([513, 17, 1024], [513, 17, 3000]), ([700], [2100])] if BIG else [
    ([37], [37]), ([20, 7, 33], [20, 7, 60]), ([9], [50])])
def test_prefill_attention(dtype, q_lens, ctx_lens):
    check_attention(*attention_case(q_lens, ctx_lens, 16, *H, dtype), dtype)


@pytest.mark.parametrize("mixed_split", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_attention(dtype, mixed_split):
    tops.MIXED_DECODE_SPLIT = mixed_split
    if BIG:
        q_lens, ctx = [1, 1, 600, 1, 0, 45, 1], [4096, 1, 1800, 333, 12, 45, 2000]
    else:
        q_lens, ctx = [1, 13, 1, 0, 6, 1], [40, 30, 1, 5, 6, 17]
    check_attention(*attention_case(q_lens, ctx, 16, *H, dtype), dtype)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replays_with_new_seq_lens():
    B, bs, cap = 6, 16, 2048
    q, cache, meta = attention_case([1] * B, [cap] * B, bs, *H, torch.bfloat16, capacity=cap)
    meta.seq_lens.copy_(torch.tensor([5, 100, 1000, 17, 2000, 64], dtype=torch.int32))
    scale = H[2] ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tops.paged_attention(q, cache, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tops.paged_attention(q, cache, meta, scale)
    for lens in ([5, 100, 1000, 17, 2000, 64], [2048, 1, 1500, 33, 2047, 700]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.paged_attention(q.float(), cache.float(), meta, scale)
        assert rel_err(out, want) <= TOL[torch.bfloat16]
