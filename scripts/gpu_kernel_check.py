#!/usr/bin/env python
"""Checks every Triton kernel (bullet_trt.kernels.triton_ops) against the torch reference, then
times decode and prefill attention against physical limits and torch SDPA.

    python scripts/gpu_kernel_check.py                  # on a CUDA GPU: correctness + speed
    python scripts/gpu_kernel_check.py --skip-bench     # correctness only
    python scripts/gpu_kernel_check.py --interpret-small  # CPU, TRITON_INTERPRET=1, small shapes

Correctness: fresh random inputs, the reference computed in fp32 on upcast inputs, fresh
outputs poisoned with NaN (triton_ops._POISON) and unused KV blocks filled with NaN, so an
unwritten output element or a read past a sequence's context shows up as a failure.
Relative error ||out - ref|| / ||ref||; exit status 1 if any case fails.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret-small", action="store_true",
                   help="run the kernels in the Triton interpreter on CPU with small shapes")
    p.add_argument("--skip-bench", action="store_true", help="correctness only")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweeps")
    p.add_argument("--no-green", action="store_true", help="skip the green-context runs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


ARGS = _parse()
if ARGS.interpret_small:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels.metadata import AttentionMetadata  # noqa: E402
from bullet_trt.kernels import triton_ops as tops  # noqa: E402

SMALL = ARGS.interpret_small
if SMALL:
    # Small tiles so that the tiny interpreter shapes still cross several tiles and splits.
    for _key in tops.DECODE_CONFIGS:
        tops.DECODE_CONFIGS[_key] = dict(BLOCK_N=16, num_warps=4, num_stages=1)
    for _key in tops.PREFILL_CONFIGS:
        tops.PREFILL_CONFIGS[_key] = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    tops.MIN_SPLIT_TOKENS = 16
if not SMALL and not torch.cuda.is_available():
    sys.exit("gpu_kernel_check: no CUDA device; use --interpret-small to run on CPU in the Triton interpreter")
DEV = torch.device("cpu" if SMALL else "cuda")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 3e-3}
DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ROWS: list[tuple] = []
GEN = torch.Generator(device=DEV).manual_seed(ARGS.seed)
CPU_GEN = torch.Generator().manual_seed(ARGS.seed + 1)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=GEN, device=DEV, dtype=torch.float32) * scale).to(dtype)


def randint(lo: int, hi: int) -> int:
    """Uniform in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=CPU_GEN))


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.float(), want.float()
    if out.shape != want.shape:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison survived: an element was never written (or overflow)
    denom = want.norm().item()
    num = (out - want).norm().item()
    return num / denom if denom > 0 else num


def record(name: str, shape: str, dtype: torch.dtype, err: float, tol: float, note: str = "") -> None:
    ok = err <= tol
    ROWS.append((name, shape, DT.get(dtype, str(dtype)), err, tol, ok, note))
    flag = "PASS" if ok else "FAIL"
    print(f"  {name:<18} {shape:<44} {DT.get(dtype, str(dtype)):<5} {err:10.3e} {tol:8.1e}  {flag}  {note}",
          flush=True)


def guarded(name: str, shape: str, dtype: torch.dtype, fn) -> None:
    """Runs one comparison; an exception counts as a failure with its message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - report and keep going
        traceback.print_exc()
        ROWS.append((name, shape, DT.get(dtype, str(dtype)), float("inf"), 0.0, False, f"EXC {type(exc).__name__}"))
        print(f"  {name:<18} {shape:<44} {DT.get(dtype, str(dtype)):<5} {'exception':>10} {'':8}  FAIL  {exc}",
              flush=True)


# ------------------------------------------------------------------------ elementwise checks


def check_rms_norm(rows: int, cols: int, dtype: torch.dtype) -> None:
    x, w = randn(rows, cols, dtype=dtype, scale=3.0), randn(cols, dtype=dtype)
    eps = 1e-6
    want = ref.rms_norm(x.float(), w.float(), eps)
    got = tops.rms_norm(x, w, eps)
    record("rms_norm", f"({rows},{cols})", dtype, rel_err(got, want), TOL[dtype])


def check_add_rms_norm(rows: int, cols: int, dtype: torch.dtype) -> None:
    x, r, w = randn(rows, cols, dtype=dtype), randn(rows, cols, dtype=dtype, scale=4.0), randn(cols, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    eps = 1e-5
    want_n, want_s = ref.add_rms_norm(x.float(), r.float(), w.float(), eps)
    got_n, got_s = tops.add_rms_norm(x, r, w, eps)
    untouched = torch.equal(x, x0) and torch.equal(r, r0)
    record("add_rms_norm.norm", f"({rows},{cols})", dtype, rel_err(got_n, want_n), TOL[dtype])
    record("add_rms_norm.sum", f"({rows},{cols})", dtype,
           rel_err(got_s, want_s) if untouched else float("inf"), TOL[dtype],
           "" if untouched else "INPUTS MODIFIED")


def check_silu_and_mul(rows: int, inter: int, dtype: torch.dtype) -> None:
    x = randn(rows, 2 * inter, dtype=dtype, scale=2.0)
    want = ref.silu_and_mul(x.float())
    got = tops.silu_and_mul(x)
    record("silu_and_mul", f"({rows},{2 * inter})", dtype, rel_err(got, want), TOL[dtype])


def _cos_sin(max_pos: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)


def check_rope(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    max_pos = 8192 if not SMALL else 256
    cs = _cos_sin(max_pos, d)
    # q as a strided view (as if sliced out of a fused projection) to exercise the strides
    fused = randn(T, hq + 2 * hkv, d, dtype=dtype)
    q, k = fused[:, :hq], fused[:, hq:hq + hkv]
    pos = torch.randint(0, max_pos, (T,), generator=GEN, device=DEV)
    wq, wk = ref.apply_rope(q.float(), k.float(), pos, cs)
    gq, gk = tops.apply_rope(q, k, pos, cs)
    shape = f"T{T} Hq{hq} Hkv{hkv} D{d}"
    record("apply_rope.q", shape, dtype, rel_err(gq, wq), TOL[dtype])
    record("apply_rope.k", shape, dtype, rel_err(gk, wk), TOL[dtype])


def check_write_kv(T: int, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    num_blocks = T // bs + 7
    cache = randn(2, num_blocks, bs, hkv, d, dtype=dtype)
    want = cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=CPU_GEN)[:T].to(DEV)
    kv = randn(T, 2 * hkv, d, dtype=dtype)  # k and v are strided views of one tensor
    k, v = kv[:, :hkv], kv[:, hkv:]
    ref.write_kv_cache(k, v, want, slots)
    tops.write_kv_cache(k, v, cache, slots)
    record("write_kv_cache", f"T{T} Hkv{hkv} D{d} bs{bs}", dtype, rel_err(cache, want), 0.0)


# ------------------------------------------------------------------------ attention checks


def make_attention_case(q_lens, ctx_lens, bs, hq, hkv, d, dtype, poison_cache=True):
    """Packed queries, a paged cache holding every context token's K/V (blocks shuffled, block 0
    and every slot past a context filled with NaN), and the metadata."""
    assert all(c >= q for q, c in zip(q_lens, ctx_lens))
    need = [max(1, math.ceil(c / bs)) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=CPU_GEN) + 1).tolist()  # block 0 never used
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    meta = AttentionMetadata.build(list(q_lens), list(ctx_lens), tables, bs, DEV)
    fill = float("nan") if poison_cache else 0.0
    cache = torch.full((2, num_blocks, bs, hkv, d), fill, dtype=dtype, device=DEV)
    slots = []
    for c, table in zip(ctx_lens, tables):
        pos = torch.arange(c)
        slots.append(torch.tensor(table, dtype=torch.int64)[pos // bs] * bs + pos % bs)
    slots = torch.cat(slots).to(DEV)
    n = slots.numel()
    ref.write_kv_cache(randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype), cache, slots)
    q = randn(sum(q_lens), hq, d, dtype=dtype)
    return q, cache, meta


def check_attention(name: str, q_lens, ctx_lens, bs, hq, hkv, d, dtype, num_sms=None,
                    mixed_split=True, splits=None) -> None:
    """num_sms: passed to set_num_sms; splits: forces the decode split count."""
    q, cache, meta = make_attention_case(q_lens, ctx_lens, bs, hq, hkv, d, dtype)
    scale = d ** -0.5
    want = ref.paged_attention(q.float(), cache.float(), meta, scale)
    old_sms, old_mixed, old_splits = tops._NUM_SMS, tops.MIXED_DECODE_SPLIT, tops.DECODE_SPLITS_OVERRIDE
    tops.set_num_sms(num_sms)
    tops.MIXED_DECODE_SPLIT = mixed_split
    tops.DECODE_SPLITS_OVERRIDE = splits
    try:
        got = tops.paged_attention(q, cache, meta, scale)
        splits = tops.decode_splits_for(len(q_lens), hkv, meta.max_seqlen_k, dtype, d, DEV)
    finally:
        tops.set_num_sms(old_sms)
        tops.MIXED_DECODE_SPLIT = old_mixed
        tops.DECODE_SPLITS_OVERRIDE = old_splits
    # Only rows of sequences with new tokens exist; all must match.
    B = len(q_lens)
    shape = (f"B{B} T{sum(q_lens)} ctx{min(ctx_lens)}-{max(ctx_lens)} "
             f"H{hq}/{hkv} D{d} bs{bs}")
    notes = []
    if meta.max_seqlen_q == 1 or (mixed_split and B > 1 and 1 in q_lens):
        notes.append(f"splits={splits}" + (f" sms={num_sms}" if num_sms else ""))
    if meta.max_seqlen_q > 1 and B > 1 and 1 in q_lens:
        notes.append("mixed->decode+prefill" if mixed_split else "mixed->prefill only")
    record(name, shape, dtype, rel_err(got, want), TOL[dtype], " ".join(notes))


def check_decode_cuda_graph() -> None:
    """Decode captured in a CUDA graph, then replayed after seq_lens grew in place: the graph
    must stay correct (token ranges come from seq_lens on the device, no host sync)."""
    B, bs, cap = 8, 16, 2048
    q, cache, meta = make_attention_case([1] * B, [cap] * B, bs, 32, 8, 128, torch.bfloat16)
    start = [randint(1, 1000) for _ in range(B)]
    meta.seq_lens.copy_(torch.tensor(start, dtype=torch.int32))
    meta.max_seqlen_k = cap  # the engine captures with its longest context
    scale = 128 ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tops.paged_attention(q, cache, meta, scale)  # compile + warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tops.paged_attention(q, cache, meta, scale)
    worst = 0.0
    for lens in (start, [min(cap, n + randint(1, 1000)) for n in start], [cap] * B):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, rel_err(out, ref.paged_attention(q.float(), cache.float(), meta, scale)))
    splits = tops.decode_splits_for(B, 8, cap, torch.bfloat16, 128, DEV)
    record("decode.cudagraph", f"B{B} ctx<= {cap} replayed at 3 seq_lens", torch.bfloat16, worst,
           TOL[torch.bfloat16], f"splits={splits}")


def rand_ctx(n: int, lo: int, hi: int, bs: int) -> list[int]:
    """n context lengths in [lo, hi]; from n > 8 on, the first ones are the extremes and
    block-boundary neighbours, the rest random."""
    special = [lo, hi, bs, bs + 1, 2 * bs - 1, hi - 1] if n > 8 else []
    return [min(hi, max(lo, special[i])) if i < len(special) else randint(lo, hi) for i in range(n)]


def run_checks() -> None:
    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    print("\n== correctness: triton_ops vs reference (fp32 on upcast inputs) ==")
    print(f"  {'name':<18} {'shape':<44} {'dtype':<5} {'rel_err':>10} {'tol':>8}  result")
    tops._POISON = True
    try:
        if SMALL:
            hidden, inter, elem_rows = [64, 96, 40], 80, [1, 7, 33]
            rope_shapes = [(5, 4, 2, 32), (9, 6, 2, 48)]
            kv_shapes = [(13, 2, 32, 4), (20, 2, 48, 8)]
            dtypes = [fp32, bf16]
        else:
            hidden, inter, elem_rows = [4096, 5120, 3000], 14336, [1, 37, 4096]
            rope_shapes = [(1, 32, 8, 128), (77, 32, 8, 128), (4096, 32, 8, 128), (33, 28, 4, 128),
                           (19, 16, 2, 64), (11, 12, 4, 96)]
            kv_shapes = [(1, 8, 128, 16), (777, 8, 128, 16), (4096, 8, 128, 32), (50, 1, 256, 16)]
            dtypes = [fp32, bf16, fp16]
        for dtype in dtypes:
            for cols in hidden:
                for rows in elem_rows:
                    guarded("rms_norm", f"({rows},{cols})", dtype, lambda: check_rms_norm(rows, cols, dtype))
                    guarded("add_rms_norm", f"({rows},{cols})", dtype, lambda: check_add_rms_norm(rows, cols, dtype))
            qk_rows, qk_d = (3 * 4, 32) if SMALL else (33 * 32, 128)
            guarded("rms_norm(qk)", f"({qk_rows},{qk_d})", dtype, lambda: check_rms_norm(qk_rows, qk_d, dtype))
            for rows in elem_rows:
                guarded("silu_and_mul", f"({rows},{2 * inter})", dtype, lambda: check_silu_and_mul(rows, inter, dtype))
            guarded("silu_and_mul", "(3,2000)", dtype, lambda: check_silu_and_mul(3, 1000 if not SMALL else 50, dtype))
            for T, hq, hkv, d in rope_shapes:
                guarded("apply_rope", f"T{T}", dtype, lambda: check_rope(T, hq, hkv, d, dtype))
            for T, hkv, d, bs in kv_shapes:
                guarded("write_kv_cache", f"T{T}", dtype, lambda: check_write_kv(T, hkv, d, bs, dtype))

        cases = attention_cases()
        for args, kwargs in cases:
            guarded(args[0], str(args[1])[:40], args[7], lambda: check_attention(*args, **kwargs))
        if not SMALL:
            guarded("decode.cudagraph", "B8", bf16, check_decode_cuda_graph)
    finally:
        tops._POISON = False


def attention_cases():
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = []

    def add(*args, **kwargs):
        cases.append((args, kwargs))

    if SMALL:
        H = (4, 2, 32)
        for dtype in (fp32, bf16):
            for bs in (4, 16):
                for B in (1, 3, 12):
                    ctx = rand_ctx(B, 1, 90, bs)
                    add("decode", [1] * B, ctx, bs, *H, dtype)
                    add("decode", [1] * B, ctx, bs, *H, dtype, splits=1)   # direct write
                    add("decode", [1] * B, ctx, bs, *H, dtype, splits=3)
                    add("decode", [1] * B, ctx, bs, *H, dtype, splits=8)   # some splits empty
            add("prefill", [37], [37], 4, *H, dtype)
            add("prefill", [20, 7, 33], [20, 7, 33], 8, *H, dtype)
            add("chunked", [20, 9], [50, 9], 4, *H, dtype)
            add("mixed", [1, 13, 1, 0, 6, 1], [40, 30, 1, 5, 6, 17], 4, *H, dtype)
            add("mixed", [1, 13, 1, 0, 6, 1], [40, 30, 1, 5, 6, 17], 4, *H, dtype, mixed_split=False)
            add("mixed", [2, 1], [9, 70], 8, *H, dtype, splits=4)
            add("decode", [1, 1], [70, 3], 4, *H, dtype, num_sms=1)
        add("decode", [1] * 3, [1, 33, 70], 8, *H, torch.float16, splits=4)
        add("mixed", [1, 21, 1], [19, 40, 5], 8, *H, torch.float16)
        for hq, hkv, d in ((6, 2, 32), (2, 2, 32), (8, 1, 64), (4, 2, 48)):
            add("decode", [1] * 3, [1, 33, 70], 8, hq, hkv, d, bf16, splits=5)
            add("mixed", [1, 21, 1], [19, 40, 5], 8, hq, hkv, d, bf16)
        return cases

    L8B = (32, 8, 128)
    for bs in (16, 32):
        for B in (1, 3, 17, 64):
            ctx = rand_ctx(B, 1, 4096, bs)
            add("decode", [1] * B, ctx, bs, *L8B, bf16)
            if bs == 16:
                add("decode", [1] * B, ctx, bs, *L8B, bf16, splits=1)    # direct write
                add("decode", [1] * B, ctx, bs, *L8B, bf16, splits=7)
                add("decode", [1] * B, ctx, bs, *L8B, bf16, splits=64)   # short contexts: empty splits
                add("decode", [1] * B, ctx, bs, *L8B, bf16, num_sms=32)  # policy for a 32-SM partition
        for B in (1, 5, 17):
            add("decode", [1] * B, rand_ctx(B, 1, 2048, bs), bs, *L8B, fp32)
        add("prefill", [4096], [4096], bs, *L8B, bf16)
    add("prefill", [1000, 17, 513, 2048], [1000, 17, 513, 2048], 16, *L8B, bf16)
    add("chunked", [512, 1024, 33], [2000, 1024, 4000], 16, *L8B, bf16)
    add("chunked", [2048], [4096], 32, *L8B, bf16)
    mixed_q = [1] * 40 + [300, 77, 1200, 0, 2]
    mixed_c = rand_ctx(40, 1, 4096, 16) + [2300, 77, 3000, 11, 4096]
    for ms in (True, False):
        add("mixed", mixed_q, mixed_c, 16, *L8B, bf16, mixed_split=ms)
    add("mixed", [1, 1, 700, 1], [4096, 1, 1500, 333], 32, *L8B, bf16, splits=16)
    add("prefill", [700], [700], 16, *L8B, fp32)
    add("chunked", [300, 1], [1000, 50], 16, *L8B, fp32)
    add("mixed", [1, 250, 1, 3], [999, 260, 4096, 3], 32, *L8B, fp32)
    for hq, hkv, d in ((8, 8, 128), (28, 4, 128), (16, 2, 64), (8, 1, 256), (12, 4, 96)):
        add("decode", [1] * 5, rand_ctx(5, 1, 3000, 16), 16, hq, hkv, d, bf16)
        add("mixed", [1, 400, 1, 37], [2000, 900, 17, 37], 16, hq, hkv, d, bf16)
    add("mixed", [1, 400, 1, 37], [2000, 900, 17, 37], 16, 8, 1, 256, fp32)
    fp16 = torch.float16
    add("decode", [1] * 17, rand_ctx(17, 1, 4096, 16), 16, *L8B, fp16)
    add("mixed", [1, 1, 700, 1], [4096, 1, 1500, 333], 16, *L8B, fp16)
    return cases


# ------------------------------------------------------------------------ benchmarks


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def read_bandwidth() -> float:
    """GB/s of torch reading 1 GiB (sum of a bf16 tensor): the limit decode should approach."""
    x = torch.ones(1 << 29, dtype=torch.bfloat16, device=DEV)
    ms = bench(lambda: x.sum())
    return x.numel() * 2 / ms / 1e6


def decode_bench_case(B: int, ctx: int, bs: int = 16, hq=32, hkv=8, d=128):
    q, cache, meta = make_attention_case([1] * B, [ctx] * B, bs, hq, hkv, d, torch.bfloat16,
                                         poison_cache=False)
    nbytes = B * ctx * hkv * d * 2 * 2 + 2 * q.numel() * 2  # K+V of every context, q in, out
    scale = d ** -0.5
    return (lambda: tops.paged_attention(q, cache, meta, scale)), nbytes, meta


def prefill_bench_case(T: int, bs: int = 16, hq=32, hkv=8, d=128):
    q, cache, meta = make_attention_case([T], [T], bs, hq, hkv, d, torch.bfloat16, poison_cache=False)
    flops = 4 * hq * d * T * (T + 1) / 2  # QK^T and PV over the causal pairs
    scale = d ** -0.5
    return (lambda: tops.paged_attention(q, cache, meta, scale)), flops


def green_streams(counts):
    """[(asked, got, stream)] of green-context streams restricted to `counts` SMs; the contexts
    stay referenced from the returned list's owner (module global)."""
    out = []
    try:
        from cuda.bindings import driver as drv

        def chk(r):
            if int(getattr(r[0], "value", r[0])) != 0:
                raise RuntimeError(f"CUDA driver error {r[0]}")
            return r[1:] if len(r) > 2 else (r[1] if len(r) == 2 else None)

        torch.cuda.init()
        cudev = chk(drv.cuDeviceGet(torch.cuda.current_device()))
        res = chk(drv.cuDeviceGetDevResource(cudev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        for n in counts:
            results, _, _ = chk(drv.cuDevSmResourceSplitByCount(1, res, 0, n))
            desc = chk(drv.cuDevResourceGenerateDesc([results[0]], 1))
            g = chk(drv.cuGreenCtxCreate(desc, cudev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
            s = chk(drv.cuGreenCtxStreamCreate(g, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
            _KEEP.append((g, s))
            out.append((n, int(results[0].sm.smCount), torch.cuda.get_stream_from_external(s)))
        return out, "cuda.bindings"
    except Exception as exc:  # noqa: BLE001
        err = f"cuda.bindings: {exc}"
    out = []
    try:
        from torch.cuda.green_contexts import GreenContext
        for n in counts:
            g = GreenContext.create(num_sms=n, device_id=torch.cuda.current_device())
            _KEEP.append(g)
            out.append((n, -(-n // 8) * 8, g.Stream()))
        return out, "torch.cuda.green_contexts"
    except Exception as exc:  # noqa: BLE001
        return [], f"{err}; torch.cuda.green_contexts: {exc}"


_KEEP: list = []


SUMMARY: list[str] = []


def _section(title: str, fn, fatal: bool = True) -> bool:
    """Runs one benchmark section; an exception is printed loudly and, if fatal, fails the run."""
    print(f"\n  {title}", flush=True)
    try:
        fn()
        return True
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        print(f"  !! {'FAILED' if fatal else 'ERROR (not counted as failure)'}: {title}: {exc}", flush=True)
        return not fatal


def bench_decode(bw: float) -> None:
    print(f"  {'case':<24} {'splits':>6} {'ms':>9} {'GB/s':>9} {'% of read BW':>12}")
    for B, ctx in ((64, 1024), (64, 4096), (8, 4096), (1, 4096), (1, 1024)):
        fn, nbytes, meta = decode_bench_case(B, ctx)
        splits = tops.decode_splits_for(B, 8, meta.max_seqlen_k, torch.bfloat16, 128, DEV)
        ms = bench(fn)
        gbs = nbytes / ms / 1e6
        print(f"  B{B:<3} ctx{ctx:<17} {splits:>6} {ms:9.4f} {gbs:9.1f} {100 * gbs / bw:11.1f}%", flush=True)
        if (B, ctx) == (64, 1024):
            SUMMARY.append(f"decode B64 ctx1024 bf16: {ms:.4f} ms, {gbs:.0f} GB/s = {100 * gbs / bw:.0f}% of "
                           f"torch read bandwidth {bw:.0f} GB/s (splits={splits})")
        del fn


def sweep_decode() -> None:
    fn, nbytes, _ = decode_bench_case(64, 1024)
    key = (False, False)
    saved = dict(tops.DECODE_CONFIGS[key])
    best = None
    try:
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    for splits in (1, 2, 4):
                        tops.DECODE_CONFIGS[key] = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                        tops.DECODE_SPLITS_OVERRIDE = splits
                        try:
                            ms = bench(fn)
                        except Exception as exc:  # noqa: BLE001
                            print(f"    BLOCK_N={block_n} warps={warps} stages={stages} splits={splits}: "
                                  f"failed: {str(exc)[:120]}")
                            continue
                        gbs = nbytes / ms / 1e6
                        best = max(best or (0,), (gbs, block_n, warps, stages, splits))
                        print(f"    BLOCK_N={block_n:<4} warps={warps} stages={stages} splits={splits}: "
                              f"{ms:8.4f} ms {gbs:8.1f} GB/s", flush=True)
    finally:
        tops.DECODE_CONFIGS[key] = saved
        tops.DECODE_SPLITS_OVERRIDE = None
    if best:
        line = f"decode sweep best: {best[0]:.0f} GB/s with BLOCK_N={best[1]} warps={best[2]} stages={best[3]} splits={best[4]}"
        print(f"    {line}")
        SUMMARY.append(line)


def bench_prefill() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for T in (4096, 1024):
        fn, flops = prefill_bench_case(T)
        ms = bench(fn)
        ours = flops / ms / 1e9
        print(f"  ours (paged)  T={T:<5} {ms:9.4f} ms {ours:8.1f} TFLOP/s", flush=True)
        del fn
        qs, ks, vs = (torch.randn(1, 32, T, 128, dtype=torch.bfloat16, device=DEV) for _ in range(3))
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            be = getattr(SDPBackend, backend, None)
            if be is None:
                continue

            def sdpa(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            try:
                ms_b = bench(sdpa)
            except Exception as exc:  # noqa: BLE001
                print(f"  torch SDPA {backend}: unavailable ({str(exc)[:100]})")
                continue
            theirs = flops / ms_b / 1e9
            name = backend.split("_")[0].lower()
            print(f"  torch SDPA {name:<6} T={T:<5} {ms_b:9.4f} ms {theirs:8.1f} TFLOP/s "
                  f"(Hq=Hkv=32 contiguous K/V, no paging); ours/{name} = {ours / theirs:.2f}", flush=True)
            if T == 4096:
                SUMMARY.append(f"prefill T4096 bf16: ours {ours:.0f} TFLOP/s, SDPA {name} {theirs:.0f} TFLOP/s "
                               f"(ratio {ours / theirs:.2f})")


def sweep_prefill() -> None:
    fn, flops = prefill_bench_case(4096)
    key = (False, False)
    saved = dict(tops.PREFILL_CONFIGS[key])
    best = None
    try:
        for bm, bn, w, st in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2),
                              (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3)):
            tops.PREFILL_CONFIGS[key] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            try:
                ms = bench(fn)
            except Exception as exc:  # noqa: BLE001
                print(f"    BLOCK_M={bm} BLOCK_N={bn} warps={w} stages={st}: failed: {str(exc)[:120]}")
                continue
            tf = flops / ms / 1e9
            best = max(best or (0,), (tf, bm, bn, w, st))
            print(f"    BLOCK_M={bm:<4} BLOCK_N={bn:<4} warps={w} stages={st}: {ms:8.4f} ms {tf:7.1f} TFLOP/s",
                  flush=True)
    finally:
        tops.PREFILL_CONFIGS[key] = saved
    if best:
        line = f"prefill sweep best: {best[0]:.0f} TFLOP/s with BLOCK_M={best[1]} BLOCK_N={best[2]} warps={best[3]} stages={best[4]}"
        print(f"    {line}")
        SUMMARY.append(line)


def bench_mixed() -> None:
    q_lens, ctx = [2048] + [1] * 63, [2048] + [1024] * 63
    q, cache, meta = make_attention_case(q_lens, ctx, 16, 32, 8, 128, torch.bfloat16, poison_cache=False)
    try:
        for flag in (True, False):
            tops.MIXED_DECODE_SPLIT = flag
            ms = bench(lambda: tops.paged_attention(q, cache, meta, 128 ** -0.5))
            how = "decode kernel + prefill kernel" if flag else "prefill kernel only"
            print(f"    MIXED_DECODE_SPLIT={flag!s:<5} ({how}): {ms:8.4f} ms", flush=True)
            SUMMARY.append(f"mixed 2048-token prefill + 63 decodes, {how}: {ms:.4f} ms")
    finally:
        tops.MIXED_DECODE_SPLIT = True


def bench_green(num_sms: int) -> None:
    streams, how = green_streams([32, 64, 96])
    if not streams:
        raise RuntimeError(f"green contexts unavailable: {how}")
    print(f"    via {how}")
    fn, nbytes, _ = decode_bench_case(64, 1024)
    x = torch.ones(1 << 28, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    try:
        for asked, got, stream in streams:
            with torch.cuda.stream(stream):
                rbw = x.numel() * 2 / bench(lambda: x.sum()) / 1e6
                tops.set_num_sms(num_sms)
                full = nbytes / bench(fn) / 1e6
                tops.set_num_sms(got)
                aware = nbytes / bench(fn) / 1e6
                splits = tops.decode_splits_for(64, 8, 1024, torch.bfloat16, 128)
            torch.cuda.synchronize()
            line = (f"{got:>3} SMs (asked {asked}): decode B64 ctx1024 {aware:7.0f} GB/s with splits={splits} "
                    f"(set_num_sms({got})); {full:7.0f} GB/s if told {num_sms} SMs; torch read {rbw:7.0f} GB/s "
                    f"-> decode at {100 * aware / rbw:.0f}% of the partition's read bandwidth")
            print(f"    {line}", flush=True)
            SUMMARY.append("green " + line)
    finally:
        tops.set_num_sms(None)


def run_bench() -> bool:
    props = torch.cuda.get_device_properties(0)
    print(f"\n== speed on {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__} ==")
    bw = read_bandwidth()
    print(f"  reference read bandwidth (torch bf16 sum of 1 GiB): {bw:8.1f} GB/s")
    ok = _section("decode attention (Hq32 Hkv8 D128 bf16 bs16; median of do_bench; bytes = K+V of all contexts)",
                  lambda: bench_decode(bw))
    if not ARGS.no_sweep:
        ok &= _section("decode sweep at B64 ctx1024 (BLOCK_N, warps, stages, forced splits)", sweep_decode, fatal=False)
    ok &= _section("prefill attention, one sequence of T tokens, causal (Hq32 Hkv8 D128 bf16 bs16)", bench_prefill)
    if not ARGS.no_sweep:
        ok &= _section("prefill sweep at T=4096 (BLOCK_M, BLOCK_N, warps, stages)", sweep_prefill, fatal=False)
    ok &= _section("mixed batch: 1 prefill of 2048 new tokens + 63 decodes at ctx 1024", bench_mixed)
    if not ARGS.no_green:
        ok &= _section("decode on green-context streams (set_num_sms = SMs of the stream)",
                       lambda: bench_green(props.multi_processor_count), fatal=False)
    print("\n== summary ==")
    for line in SUMMARY:
        print(f"  {line}")
    return ok


def main() -> int:
    t0 = time.time()
    where = "Triton interpreter on CPU (small shapes)" if SMALL else torch.cuda.get_device_name(0)
    import triton
    print(f"gpu_kernel_check: {where}; torch {torch.__version__}, triton {triton.__version__}")
    run_checks()
    failed = [r for r in ROWS if not r[5]]
    print(f"\n== {len(ROWS) - len(failed)}/{len(ROWS)} checks passed ({time.time() - t0:.1f} s) ==")
    for r in failed:
        print(f"  FAIL {r[0]} {r[1]} {r[2]} rel_err={r[3]:.3e} tol={r[4]:.1e} {r[6]}")
    bench_ok = True
    if not SMALL and not ARGS.skip_bench:
        try:
            bench_ok = run_bench()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            bench_ok = False
    print(f"\n== total {time.time() - t0:.1f} s: {'FAILED' if failed or not bench_ok else 'OK'} ==")
    return 1 if failed or not bench_ok else 0


if __name__ == "__main__":
    sys.exit(main())
