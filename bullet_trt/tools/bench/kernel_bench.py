"""`bullet-trt bench kernels`: the GPU's ceilings, then the engine and its attention kernels
against them.

Engine (with --engine-dir): the device-to-device copy bandwidth and the bf16 GEMM rate at each
SM count (green-context streams), then the engine's decode step (batch 64, context 1024) and
prefill (4096 tokens) at the same SM counts. Each engine time is reported as a fraction of its
roofline: bytes it must move over the measured copy bandwidth (decode), FLOPs over the
measured GEMM rate (prefill).

Attention (unless --no-attention; Llama-3.1-8B heads: Hq 32, Hkv 8, D 128, bf16, block 16):
paged decode attention as GB/s against torch's read bandwidth (a bf16 sum of 1 GiB), paged
prefill attention as TFLOP/s against torch SDPA (flash, cuDNN) on contiguous K/V, a mixed batch
with and without the decode kernel split out, and decode attention on each green partition
against that partition's read bandwidth, with the kernel told the partition's SM count and the
whole GPU's. --sweep adds the tile-configuration sweeps of both kernels.

--compare-blas (with --engine-dir): the decode step and the prefill on each SM count under
cuBLAS, cuBLASLt, and cuBLASLt told the partition's SM count (what the engine runs). Decode
graphs are recaptured per setting: a graph keeps the GEMMs chosen when it was captured.

    bullet-trt bench kernels --engine-dir engines/llama-3.1-8b [--sms 32,64,96] [--json out.json]
    bullet-trt bench kernels --no-engine-table ...   # attention only (no engine directory needed)

Correctness of the same kernels is tests/gpu/test_triton_kernels.py's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from bullet_trt.spatial.calibrate import measurement_setup, profile_items, time_ms
from bullet_trt.spatial.perf_model import ModelCost, PrefillShape
from bullet_trt.tools.bench.json_output import write_json

L8B_HEADS = (32, 8, 128)  # Hq, Hkv, head dim
DECODE_CASES = ((64, 1024), (64, 4096), (8, 4096), (1, 4096), (1, 1024))  # (batch, context)
PREFILL_TOKENS = (4096, 1024)
BLAS_SETTINGS = ("cublas", "cublaslt", "cublaslt+sm_target")


def copy_gbs(stream) -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), stream, repeats=5)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def prefill_work_flops(cost, arch, shape, num_prompts: int) -> float:
    """The FLOPs a prefill really does: every token through the layers, but the lm_head only
    for each prompt's last token (the only logits computed); ModelCost counts the lm_head
    for every token, which overstated the prefill's share of the GEMM rate by ~6 points."""
    unused_logits = 2.0 * arch.vocab_size * arch.hidden_size * (shape.num_tokens - num_prompts)
    return cost.flops_per_token * shape.num_tokens - unused_logits + cost.attn_flops_per_pair * shape.attn_pairs


def gemm_tflops(stream) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_ms(lambda: a @ b, stream, repeats=5)
    return 2 * 8192 ** 3 / ms / 1e9


# -- the engine ---------------------------------------------------------------------------------

def run(setup, batch: int = 64, ctx: int = 1024, prefill_tokens: int = 4096) -> list[dict]:
    """setup: what spatial.calibrate.measurement_setup returns."""
    from bullet_trt.kernels import ops_for

    cfg, state, session, streams = setup
    cost = ModelCost.of_state(state)
    set_num_sms = getattr(ops_for(state.kv_pool.device), "set_num_sms", None)
    decode_items = profile_items([ctx] * batch, True, state.block_size, state.arch.vocab_size)
    prefill_items = profile_items([prefill_tokens], False, state.block_size, state.arch.vocab_size)
    shape = PrefillShape.of([prefill_tokens])
    rows = []
    for sms, stream in sorted(streams.items()):
        if set_num_sms:
            set_num_sms(sms)
        bw, rate = copy_gbs(stream), gemm_tflops(stream)
        decode_ms = time_ms(lambda: session.run(decode_items), stream, repeats=10)
        prefill_ms = time_ms(lambda: session.run(prefill_items), stream, repeats=3)
        decode_bytes = cost.step_weight_bytes(batch) + cost.kv_bytes_per_token * batch * ctx
        prefill_flops = prefill_work_flops(cost, state.arch, shape, num_prompts=1)
        rows.append({
            "sms": sms, "copy_GBps": round(bw, 1), "gemm_TFLOPs": round(rate, 1),
            "decode_ms": round(decode_ms, 3), "decode_GBps": round(decode_bytes / decode_ms / 1e6, 1),
            "decode_frac_of_copy_bw": round(decode_bytes / decode_ms / 1e6 / bw, 3),
            "prefill_ms": round(prefill_ms, 3), "prefill_TFLOPs": round(prefill_flops / prefill_ms / 1e9, 1),
            "prefill_frac_of_gemm": round(prefill_flops / prefill_ms / 1e9 / rate, 3),
        })
        print(json.dumps(rows[-1]), flush=True)
    if set_num_sms:
        set_num_sms(None)
    return rows


def markdown(rows: list[dict], batch: int, ctx: int, tokens: int) -> str:
    lines = [f"| SMs | copy GB/s | bf16 GEMM TFLOP/s | decode B{batch} ctx{ctx} ms | decode GB/s | "
             f"of copy BW | prefill {tokens} ms | prefill TFLOP/s | of GEMM rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sms']} | {r['copy_GBps']} | {r['gemm_TFLOPs']} | {r['decode_ms']} | "
                     f"{r['decode_GBps']} | {r['decode_frac_of_copy_bw']:.0%} | {r['prefill_ms']} | "
                     f"{r['prefill_TFLOPs']} | {r['prefill_frac_of_gemm']:.0%} |")
    return "\n".join(lines)


def _blas(setting: str, sms: int, set_num_sms) -> None:
    """The Triton kernels always follow the partition; the GEMMs per `setting`."""
    torch.backends.cuda.preferred_blas_library("cublas" if setting == "cublas" else "cublaslt")
    set_num_sms(sms)
    if not setting.endswith("sm_target") and hasattr(torch._C, "_set_sm_carveout_experimental"):
        torch._C._set_sm_carveout_experimental(None)


def compare_blas(setup, batch: int = 64, ctx: int = 1024, prefill_tokens: int = 4096) -> list[dict]:
    from bullet_trt.engine.cuda_graphs import DecodeGraphs
    from bullet_trt.kernels import triton_ops

    cfg, state, session, streams = setup
    decode_items = profile_items([ctx] * batch, True, state.block_size, state.arch.vocab_size)
    prefill_items = profile_items([prefill_tokens], False, state.block_size, state.arch.vocab_size)
    settings = [s for s in BLAS_SETTINGS
                if not s.endswith("sm_target") or hasattr(torch._C, "_set_sm_carveout_experimental")]
    before = torch.backends.cuda.preferred_blas_library()
    retired, rows = [], []
    try:
        for sms, stream in sorted(streams.items()):
            for setting in settings:
                _blas(setting, sms, triton_ops.set_num_sms)
                if session.graphs is not None:
                    g = session.graphs
                    retired.append(g)  # a graph pool is not reused once captured into
                    session.graphs = DecodeGraphs(g.model, g.kv_pool, g.block_size, g.batch_sizes, g.max_model_len)
                rows.append({"sms": sms, "blas": setting,
                             "decode_ms": round(time_ms(lambda: session.run(decode_items), stream, repeats=10), 3),
                             "prefill_ms": round(time_ms(lambda: session.run(prefill_items), stream, repeats=3), 3)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
        triton_ops.set_num_sms(None)
    return rows


# -- the attention kernels ------------------------------------------------------------------------

def do_bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median ms on the current stream (Triton's bench: warm-up, L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def read_gbs(gib: float = 1.0) -> float:
    """GB/s of torch reading a bf16 tensor (a sum): what a kernel that only reads can reach."""
    x = torch.ones(int(gib * (1 << 29)), dtype=torch.bfloat16, device="cuda")
    gbs = x.numel() * 2 / do_bench(x.sum) / 1e6
    del x
    return gbs


def paged_case(q_lens: list[int], ctx_lens: list[int], block_size: int = 16, heads=L8B_HEADS,
               dtype=torch.bfloat16, cache_dtype=None):
    """(q, KV cache, metadata): every context's blocks in the cache, shuffled."""
    from bullet_trt.kernels.metadata import AttentionMetadata

    hq, hkv, d = heads
    need = [math.ceil(c / block_size) for c in ctx_lens]
    perm = torch.randperm(sum(need)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    meta = AttentionMetadata.build(list(q_lens), list(ctx_lens), tables, block_size, "cuda")
    cache = torch.randn(2, sum(need), block_size, hkv, d, device="cuda", dtype=dtype).to(cache_dtype or dtype)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype)
    return q, cache, meta


def decode_case(batch: int, ctx: int, heads=L8B_HEADS, cache_dtype=torch.bfloat16):
    """(fn, bytes it must read and write, splits): K and V of every context, q in, out."""
    from bullet_trt.kernels import triton_ops as tops

    hq, hkv, d = heads
    q, cache, meta = paged_case([1] * batch, [ctx] * batch, heads=heads, cache_dtype=cache_dtype)
    nbytes = batch * ctx * hkv * d * 2 * cache.element_size() + 2 * q.numel() * 2
    splits = tops.decode_splits_for(batch, hkv, ctx, torch.bfloat16, d, cache_dtype=cache.dtype)
    return (lambda: tops.paged_attention(q, cache, meta, d ** -0.5)), nbytes, splits


def prefill_case(tokens: int, heads=L8B_HEADS):
    """(fn, FLOPs): QK^T and PV over the causal pairs of one prompt."""
    from bullet_trt.kernels import triton_ops as tops

    hq, hkv, d = heads
    q, cache, meta = paged_case([tokens], [tokens], heads=heads)
    flops = 4 * hq * d * tokens * (tokens + 1) / 2
    return (lambda: tops.paged_attention(q, cache, meta, d ** -0.5)), flops


def sdpa_tflops(tokens: int, flops: float) -> dict[str, float]:
    """torch SDPA on contiguous K/V with Hq = Hkv (no paging, no grouped heads): TFLOP/s per
    backend that runs here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, _, d = L8B_HEADS
    q, k, v = (torch.randn(1, hq, tokens, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def sdpa(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            out[name.split("_")[0].lower()] = round(flops / do_bench(sdpa) / 1e9, 1)
        except RuntimeError as e:  # the backend does not run on this GPU / build
            print(f"torch SDPA {name}: unavailable ({str(e)[:100]})", flush=True)
    return out


def attention(partitions: dict[int, object], total: int) -> dict:
    """partitions: {SM count: green-context stream} besides the whole GPU."""
    from bullet_trt.kernels import triton_ops as tops

    bw = read_gbs()
    out: dict = {"read_GBps": round(bw, 1), "decode": [], "prefill": [], "mixed": [], "partitions": []}
    print(json.dumps({"read_GBps": out["read_GBps"]}), flush=True)
    for batch, ctx in DECODE_CASES:
        fn, nbytes, splits = decode_case(batch, ctx)
        ms = do_bench(fn)
        out["decode"].append({"batch": batch, "ctx": ctx, "splits": splits, "ms": round(ms, 4),
                              "GBps": round(nbytes / ms / 1e6, 1), "of_read_bw": round(nbytes / ms / 1e6 / bw, 3)})
        print(json.dumps(out["decode"][-1]), flush=True)
        del fn
    for tokens in PREFILL_TOKENS:
        fn, flops = prefill_case(tokens)
        ms = do_bench(fn)
        del fn
        ours = flops / ms / 1e9
        theirs = sdpa_tflops(tokens, flops)
        out["prefill"].append({"tokens": tokens, "ms": round(ms, 4), "TFLOPs": round(ours, 1),
                               **{f"sdpa_{k}_TFLOPs": v for k, v in theirs.items()},
                               **{f"of_sdpa_{k}": round(ours / v, 2) for k, v in theirs.items()}})
        print(json.dumps(out["prefill"][-1]), flush=True)
    # one prompt of 2048 new tokens beside 63 decoding sequences at context 1024
    q, cache, meta = paged_case([2048] + [1] * 63, [2048] + [1024] * 63)
    try:
        for split in (True, False):
            tops.MIXED_DECODE_SPLIT = split
            ms = do_bench(lambda: tops.paged_attention(q, cache, meta, L8B_HEADS[2] ** -0.5))
            out["mixed"].append({"decode_kernel_split_out": split, "ms": round(ms, 4)})
            print(json.dumps(out["mixed"][-1]), flush=True)
    finally:
        tops.MIXED_DECODE_SPLIT = True
    del q, cache, meta
    fn, nbytes, _ = decode_case(64, 1024)
    try:
        for sms, stream in sorted(partitions.items()):
            if sms >= total:
                continue
            with torch.cuda.stream(stream):
                part_bw = read_gbs(0.5)
                tops.set_num_sms(total)
                told_total = nbytes / do_bench(fn) / 1e6
                tops.set_num_sms(sms)
                aware = nbytes / do_bench(fn) / 1e6
                splits = tops.decode_splits_for(64, L8B_HEADS[1], 1024, torch.bfloat16, L8B_HEADS[2])
            torch.cuda.synchronize()
            out["partitions"].append({"sms": sms, "read_GBps": round(part_bw, 1), "splits": splits,
                                      "decode_GBps": round(aware, 1), "of_read_bw": round(aware / part_bw, 3),
                                      "decode_GBps_told_whole_gpu": round(told_total, 1)})
            print(json.dumps(out["partitions"][-1]), flush=True)
    finally:
        tops.set_num_sms(None)
    return out


def sweep_decode(batch: int = 64, ctx: int = 1024, heads=L8B_HEADS, cache_dtype=torch.bfloat16,
                 block_ns=(32, 64, 128), stages_list=(2, 3), splits_list=(1, 2, 4)) -> list[dict]:
    """Tile configurations of the decode kernel over a cache of ``cache_dtype`` (bf16 queries, head
    dim <= 128), with forced split counts; the module's table is restored after. Each row: the
    rate it reads the cache at, and its time."""
    from bullet_trt.kernels import triton_ops as tops

    table, key = tops.decode_config_table(torch.bfloat16, heads[2], cache_dtype)
    fn, nbytes, chosen = decode_case(batch, ctx, heads, cache_dtype)
    saved, rows = dict(table[key]), []
    case = {"batch": batch, "ctx": ctx, "heads": list(heads), "cache": str(cache_dtype).removeprefix("torch."),
            "fp8_cache_dot_fp16": tops.FP8_CACHE_DOT_FP16}

    def timed(row: dict) -> dict:
        ms = do_bench(fn)
        return {**row, **case, "GBps": round(nbytes / ms / 1e6, 1), "ms": round(ms, 4)}

    try:
        for block_n, warps, stages, splits in itertools.product(block_ns, (4, 8), stages_list, splits_list):
            table[key] = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            tops.DECODE_SPLITS_OVERRIDE = splits
            row = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "splits": splits}
            try:
                row = timed(row)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                row.update(case, error=str(e)[:120])
            rows.append(row)
            print(json.dumps(row), flush=True)
        table[key] = saved
        tops.DECODE_SPLITS_OVERRIDE = None
        rows.append(timed({"shipped": saved, "splits": chosen}))
        print(json.dumps(rows[-1]), flush=True)
    finally:
        table[key] = saved
        tops.DECODE_SPLITS_OVERRIDE = None
    return rows


def sweep() -> dict:
    """Tile configurations of the decode kernel (B64 ctx1024, with forced split counts) and the
    prefill kernel (4096 tokens), bf16 head dim 128; the module's tables are restored after."""
    from bullet_trt.kernels import triton_ops as tops

    key = (False, False)  # bf16/fp16, head dim <= 128
    out: dict = {"decode": sweep_decode(), "prefill": []}
    fn, flops = prefill_case(4096)
    saved = dict(tops.PREFILL_CONFIGS[key])
    try:
        for bm, bn, warps, stages in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2),
                                      (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3)):
            tops.PREFILL_CONFIGS[key] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            row = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                row["TFLOPs"] = round(flops / do_bench(fn) / 1e9, 1)
            except Exception as e:  # noqa: BLE001
                row["error"] = str(e)[:120]
            out["prefill"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        tops.PREFILL_CONFIGS[key] = saved
    return out


def attention_markdown(att: dict) -> str:
    hq, hkv, d = L8B_HEADS
    lines = [f"Attention kernels (Hq {hq}, Hkv {hkv}, D {d}, bf16, block 16); torch read bandwidth "
             f"{att['read_GBps']} GB/s", "",
             "| decode | splits | ms | GB/s | of read BW |", "|---|---|---|---|---|"]
    lines += [f"| B{r['batch']} ctx{r['ctx']} | {r['splits']} | {r['ms']} | {r['GBps']} | {r['of_read_bw']:.0%} |"
              for r in att["decode"]]
    lines += ["", "| prefill, causal | ms | TFLOP/s | SDPA flash | SDPA cuDNN |", "|---|---|---|---|---|"]
    for r in att["prefill"]:
        sdpa = [f"{r[f'sdpa_{k}_TFLOPs']} (ours {r[f'of_sdpa_{k}']}x)" if f"sdpa_{k}_TFLOPs" in r else "-"
                for k in ("flash", "cudnn")]
        lines.append(f"| {r['tokens']} tokens | {r['ms']} | {r['TFLOPs']} | {sdpa[0]} | {sdpa[1]} |")
    lines += ["", "| mixed: 2048-token prompt + 63 decodes at ctx 1024 | ms |", "|---|---|"]
    lines += [f"| {'decode kernel + prefill kernel' if r['decode_kernel_split_out'] else 'prefill kernel only'} "
              f"| {r['ms']} |" for r in att["mixed"]]
    if att["partitions"]:
        lines += ["", "| green partition | read GB/s | decode B64 ctx1024 GB/s | of partition read BW | "
                  "GB/s if told the whole GPU |", "|---|---|---|---|---|"]
        lines += [f"| {r['sms']} SMs | {r['read_GBps']} | {r['decode_GBps']} (splits {r['splits']}) | "
                  f"{r['of_read_bw']:.0%} | {r['decode_GBps_told_whole_gpu']} |" for r in att["partitions"]]
    return "\n".join(lines)


def blas_markdown(rows: list[dict], batch: int, ctx: int, tokens: int) -> str:
    lines = [f"| SMs | BLAS | decode B{batch} ctx{ctx} ms | prefill {tokens} ms |", "|---|---|---|---|"]
    lines += [f"| {r['sms']} | {r['blas']} | {r['decode_ms']} | {r['prefill_ms']} |" for r in rows]
    return "\n".join(lines)


def _green_streams(sm_counts: list[int]) -> tuple[object | None, dict[int, object]]:
    from bullet_trt.spatial.partitioners import make_partitioner

    try:
        part = make_partitioner("green", "cuda")
    except RuntimeError as e:
        print(f"no green partitions: {e}", flush=True)
        return None, {}
    counts = [c for c in sm_counts if c < part.total_sms]
    part.prepare("prefill", counts)
    return part, {c: part.stream(c) for c in counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", help="engine to time (the engine table and --compare-blas need it)")
    ap.add_argument("--no-engine-table", action="store_true", help="skip the engine table")
    ap.add_argument("--no-attention", action="store_true", help="skip the attention-kernel tables")
    ap.add_argument("--sweep", action="store_true", help="also sweep the attention kernels' tile configurations")
    ap.add_argument("--compare-blas", action="store_true",
                    help="time the engine under cuBLAS, cuBLASLt and cuBLASLt with the SM target")
    ap.add_argument("--sms", default="32,64,96", help="partition sizes besides the whole GPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--sweep-decode", metavar="HQ,HKV,D",
                    help="only sweep the decode kernel's tiles at --batch x --ctx for these heads "
                         "(32,4,128: Qwen3-30B-A3B), over a cache of --kv-dtype")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the cache --sweep-decode reads")
    ap.add_argument("--fp8-dot", choices=("fp16", "bf16"), default=None,
                    help="--sweep-decode over an FP8 cache: the dtype its products take (default: the kernels')")
    ap.add_argument("--json", help="write every table's rows here, by section")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels needs a CUDA GPU")
    if args.sweep_decode:
        heads = tuple(int(x) for x in args.sweep_decode.split(","))
        cache = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
        if args.fp8_dot is not None:
            from bullet_trt.kernels import triton_ops as tops
            tops.FP8_CACHE_DOT_FP16 = args.fp8_dot == "fp16"
        rows = sweep_decode(args.batch, args.ctx, heads, cache, block_ns=(64, 128, 256),
                            stages_list=(2, 3, 4), splits_list=(1, 2))
        write_json(args.json, {"decode_sweep": rows})
        return 0
    engine_table = not args.no_engine_table
    if (engine_table or args.compare_blas) and not args.engine_dir:
        raise SystemExit("bench kernels: --engine-dir is needed for the engine table (or --no-engine-table) "
                         "and for --compare-blas")
    sm_counts = [int(x) for x in args.sms.split(",") if x]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    result: dict = {}
    tables: list[str] = []
    setup = None
    if engine_table or args.compare_blas:
        setup = measurement_setup(args.engine_dir, sm_counts, {"kv.gpu_memory_fraction": 0.6})
    if engine_table:
        result["engine"] = run(setup, args.batch, args.ctx, args.prefill_tokens)
        tables.append(markdown(result["engine"], args.batch, args.ctx, args.prefill_tokens))
    if args.compare_blas:
        result["blas"] = compare_blas(setup, args.batch, args.ctx, args.prefill_tokens)
        tables.append(blas_markdown(result["blas"], args.batch, args.ctx, args.prefill_tokens))
    if not args.no_attention:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if setup is not None:
            part, streams = None, setup[3]  # the engine's partitions, kept alive by its session
        else:
            part, streams = _green_streams(sm_counts)
        result["attention"] = attention(streams, total)
        tables.append(attention_markdown(result["attention"]))
        if args.sweep:
            result["sweep"] = sweep()
        if part is not None:
            part.close()
    print("\n\n".join(tables))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
