"""`bullet-trt bench kernels`: the GPU's two ceilings, then the engine against them.

Measures, in one run and on the same partitions: the device-to-device copy bandwidth and the
bf16 GEMM rate at each SM count (green-context streams), then the engine's decode step
(batch 64, context 1024) and prefill (4096 tokens) at the same SM counts. Each engine time is
reported as a fraction of its roofline: bytes it must move over the measured copy bandwidth
(decode), FLOPs over the measured GEMM rate (prefill).

    bullet-trt bench kernels --engine-dir engines/llama-3.1-8b [--sms 32,64,96] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from bullet_trt.spatial.calibrate import measurement_setup, profile_items, time_ms
from bullet_trt.spatial.perf_model import ModelCost, PrefillShape


def copy_gbs(stream) -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), stream, repeats=5)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def gemm_tflops(stream) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_ms(lambda: a @ b, stream, repeats=5)
    return 2 * 8192 ** 3 / ms / 1e9


def run(engine_dir: str, sm_counts: list[int], batch: int = 64, ctx: int = 1024,
        prefill_tokens: int = 4096) -> list[dict]:
    from bullet_trt.kernels import ops_for

    cfg, state, session, streams = measurement_setup(engine_dir, sm_counts, {"kv.gpu_memory_fraction": 0.6})
    cost = ModelCost.from_arch(state.arch, state.kv_pool.element_size())
    set_num_sms = getattr(ops_for(state.kv_pool.device), "set_num_sms", None)
    decode_items = profile_items([ctx] * batch, True, state.block_size)
    prefill_items = profile_items([prefill_tokens], False, state.block_size)
    shape = PrefillShape.of([prefill_tokens])
    rows = []
    for sms, stream in sorted(streams.items()):
        if set_num_sms:
            set_num_sms(sms)
        bw, rate = copy_gbs(stream), gemm_tflops(stream)
        decode_ms = time_ms(lambda: session.run(decode_items), stream, repeats=10)
        prefill_ms = time_ms(lambda: session.run(prefill_items), stream, repeats=3)
        decode_bytes = cost.weight_bytes + cost.kv_bytes_per_token * batch * ctx
        prefill_flops = cost.flops_per_token * shape.num_tokens + cost.attn_flops_per_pair * shape.attn_pairs
        rows.append({
            "sms": sms, "copy_GBps": round(bw, 1), "gemm_TFLOPs": round(rate, 1),
            "decode_ms": round(decode_ms, 3), "decode_GBps": round(decode_bytes / decode_ms / 1e6, 1),
            "decode_frac_of_copy_bw": round(decode_bytes / decode_ms / 1e6 / bw, 3),
            "prefill_ms": round(prefill_ms, 3), "prefill_TFLOPs": round(prefill_flops / prefill_ms / 1e9, 1),
            "prefill_frac_of_gemm": round(prefill_flops / prefill_ms / 1e9 / rate, 3),
        })
        print(json.dumps(rows[-1]), flush=True)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--sms", default="32,64,96", help="partition sizes besides the whole GPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = run(args.engine_dir, [int(x) for x in args.sms.split(",") if x], args.batch, args.ctx,
               args.prefill_tokens)
    print(markdown(rows, args.batch, args.ctx, args.prefill_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
