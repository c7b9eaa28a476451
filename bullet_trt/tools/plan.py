"""`bullet-trt plan`: what each GPU would hold serving a model at given tensor-parallel sizes
(weights, KV pool, rows at a typical context), before a machine of that size is at hand.

    bullet-trt plan --arch llama-3.1-70b --tp 2,4,8 --gpu-memory-gib 139.8
    bullet-trt plan --engine-dir engines/llama8b --tp 1
"""
from __future__ import annotations

import argparse

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.serving.memory_plan import table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt plan", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--arch", choices=sorted(PRESETS), help="a preset architecture (dummy-weight engines)")
    src.add_argument("--engine-dir", help="an engine directory (its checkpoint's config.json)")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (default 1)")
    ap.add_argument("--gpu-memory-gib", type=float, default=139.8,
                    help="memory of one GPU in GiB (default 139.8, an H200; an H100 has 79.2)")
    ap.add_argument("--memory-fraction", type=float, default=0.85, help="kv.gpu_memory_fraction (default 0.85)")
    ap.add_argument("--dtype-bytes", type=int, default=2, choices=(1, 2, 4), help="bytes per weight (default 2: bf16)")
    ap.add_argument("--fp8-experts", action="store_true",
                    help="an MoE model's experts in FP8 blocks (quantization=fp8): a byte a weight")
    ap.add_argument("--fp8-kv", action="store_true", help="K and V cached in FP8 (kv.cache_dtype=fp8): a byte a value")
    args = ap.parse_args(argv)
    if args.arch:
        name, arch = args.arch, ModelArch.from_hf_dict(PRESETS[args.arch], source=args.arch)
    else:
        from bullet_trt.config import load_engine_config

        cfg = load_engine_config(args.engine_dir)
        name, arch = args.engine_dir, ModelArch.from_checkpoint(cfg.checkpoint_path)
    try:
        tps = [int(x) for x in args.tp.split(",") if x.strip()]
        print(table(name, arch, args.dtype_bytes, tps, args.gpu_memory_gib, args.memory_fraction, args.fp8_experts,
                    1 if args.fp8_kv else None))
    except ValueError as e:
        raise SystemExit(f"bullet-trt plan: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
