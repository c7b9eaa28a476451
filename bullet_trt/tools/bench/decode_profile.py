"""`bullet-trt bench decode-profile`: where the time of one decode step goes, on a CUDA GPU.

    bullet-trt bench decode-profile --engine-dir engines/llama-3.1-8b [--batch 64 --ctx 1024] [--set KEY=VALUE ...]
        [--json out.json]

Prints, for the engine's decode step at (batch, ctx) on the whole GPU:
- the whole step (host staging, graph replay, sampling, the sync that returns tokens), the
  graph replay alone, and the host staging alone;
- the GPU kernels of one eager step grouped by kind, with their share of the GPU time
  (torch profiler), so the gap to the roofline can be attributed;
- each projection GEMM of the model at M=batch, alone, as bytes read per second against the
  measured copy bandwidth (fused q/k/v and gate/up next to the separate ones).
Writes everything as JSON to --json when given.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from bullet_trt.config import parse_overrides
from bullet_trt.spatial.calibrate import measurement_setup, profile_items, time_ms
from bullet_trt.spatial.perf_model import ModelCost
from bullet_trt.tools.bench.kernel_bench import copy_gbs
from bullet_trt.tools.bench.json_output import write_json

KINDS = (("attention", ("_decode",)), ("moe experts", ("_moe_gemm",)),
         ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "gemv", "splitk")),
         ("norm", ("rms_norm",)), ("rope", ("_rope",)), ("kv write", ("_write_kv",)),
         ("silu", ("_silu",)), ("sampling/argmax", ("argmax", "reduce", "max")),
         ("copy/cast", ("copy", "elementwise", "cat", "fill")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_breakdown(fn, steps: int = 3) -> tuple[list[dict], float, list[dict]]:
    """(kernels by their GPU time a step, that time's sum, the torch ops that launched the
    most of it with their input shapes: which copy or cast a nameless elementwise kernel is)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ops = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)
    op_rows = [{"op": e.key, "input_shapes": str(e.input_shapes)[:160],
                "ms_per_step": round(e.self_device_time_total / 1000 / steps, 4),
                "calls_per_step": round(e.count / steps, 1)} for e in ops[:25]]
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per_kernel[ev.name][0] += ev.device_time_total / 1000 / steps
            per_kernel[ev.name][1] += 1 / steps
    total = sum(ms for ms, _ in per_kernel.values())
    rows = sorted(({"kernel": k[:90], "kind": kind_of(k), "ms_per_step": round(ms, 4),
                    "launches_per_step": round(n, 1)} for k, (ms, n) in per_kernel.items()),
                  key=lambda r: -r["ms_per_step"])
    return rows, total, op_rows


def gemm_rates(hidden: int, inter: int, q_size: int, kv_size: int, vocab: int, batch: int,
               bw: float, stream) -> list[dict]:
    shapes = {"q": (q_size, hidden), "k": (kv_size, hidden), "v": (kv_size, hidden),
              "qkv fused": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size),
              "gate": (inter, hidden), "up": (inter, hidden), "gate_up fused": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (vocab, hidden)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: F.linear(x, w), stream, repeats=20)
        gbs = w.numel() * 2 / ms / 1e6
        rows.append({"gemm": name, "N": n, "K": k, "ms": round(ms, 4), "GBps": round(gbs, 1),
                     "of_copy_bw": round(gbs / bw, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench decode-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine overrides (quantization=fp8-w8a8, kv.cache_dtype=fp8, decode graphs for --batch, ...)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench decode-profile needs a CUDA GPU")

    overrides = parse_overrides(args.set)
    cfg, state, session, streams = measurement_setup(args.engine_dir, [], {"kv.gpu_memory_fraction": 0.6, **overrides})
    stream = streams[max(streams)]
    arch, model = state.arch, session.model
    cost = ModelCost.of_state(state)
    bw = copy_gbs(stream)
    items = profile_items([args.ctx] * args.batch, True, state.block_size, arch.vocab_size)
    roofline_ms = (cost.step_weight_bytes(args.batch) + cost.kv_bytes_per_token * args.batch * args.ctx) / bw / 1e6
    report: dict = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "ctx": args.ctx,
                    "copy_GBps": round(bw, 1), "roofline_ms": round(roofline_ms, 3),
                    "fused_groups": model.fused_groups, "layers": arch.num_layers, "overrides": overrides,
                    "kv_cache_dtype": str(state.kv_pool.dtype).removeprefix("torch.")}

    graphs = session.graphs
    b = graphs.bucket(args.batch) if graphs is not None else None
    if b is None:
        raise SystemExit(f"bench decode-profile: no decode CUDA graph holds batch {args.batch} "
                         f"(decode.cuda_graph_batch_sizes of {args.engine_dir})")
    step_ms = time_ms(lambda: session.run(items), stream, repeats=20)
    with torch.cuda.stream(stream):
        # The whole GPU's default stream replays graphs captured on a side stream.
        graph = next(g for (_, bucket), g in graphs.graphs.items() if bucket == b)
        replay_ms = time_ms(graph.replay, stream, repeats=20)
        toks, pos = [it.input_token_ids[0] for it in items], [it.start_pos for it in items]
        tables = [it.block_table for it in items]
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graphs._stage(toks, pos, tables, b)
        stream.synchronize()
        stage_ms = (time.perf_counter() - t0) / 20 * 1e3
    report.update(step_ms=round(step_ms, 3), replay_ms=round(replay_ms, 3), stage_ms=round(stage_ms, 3),
                  step_of_roofline=round(roofline_ms / step_ms, 3),
                  replay_of_roofline=round(roofline_ms / replay_ms, 3))
    print(json.dumps({k: v for k, v in report.items()}), flush=True)

    saved, session.graphs = session.graphs, None  # eager: the profiler sees every kernel
    with torch.cuda.stream(stream):
        rows, gpu_ms, op_rows = kernel_breakdown(lambda: session.run(items))
    session.graphs = saved
    by_kind: dict[str, float] = defaultdict(float)
    for r in rows:
        by_kind[r["kind"]] += r["ms_per_step"]
    report["eager_gpu_ms"] = round(gpu_ms, 3)
    report["by_kind"] = {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    report["kernels"] = rows[:30]
    report["ops"] = op_rows
    print(f"eager step: {gpu_ms:.3f} ms of GPU kernels; by kind:", flush=True)
    for kind, ms in report["by_kind"].items():
        print(f"  {kind:16s} {ms:8.3f} ms  {ms / gpu_ms:6.1%}")
    for r in rows[:20]:
        print(f"  {r['ms_per_step']:8.4f} ms x{r['launches_per_step']:<5} {r['kind']:10s} {r['kernel']}")
    print("torch ops by the GPU time of the kernels they launched:", flush=True)
    for r in op_rows[:15]:
        print(f"  {r['ms_per_step']:8.4f} ms x{r['calls_per_step']:<5} {r['op']} {r['input_shapes']}")

    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    with torch.cuda.stream(stream):
        report["gemms"] = gemm_rates(arch.hidden_size, arch.intermediate_size, q_size, kv_size,
                                     arch.vocab_size, args.batch, bw, stream)
    for r in report["gemms"]:
        print(f"  gemm {r['gemm']:14s} N={r['N']:6d} K={r['K']:5d} {r['ms']:.4f} ms "
              f"{r['GBps']:7.1f} GB/s {r['of_copy_bw']:.0%} of copy BW")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
