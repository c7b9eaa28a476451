"""`bullet-trt bench calibrations`: two calibrations of one model side by side, as the scheduler
reads them.

    bullet-trt bench calibrations OLD.yaml NEW.yaml --arch qwen3-30b-a3b [--fp8-experts] [--fp8-kv]
        [--decode 500x600@132,785x600@108] [--prefill 8x200@24,1x2048@132] [--json]

Each row is one step as the performance model predicts it from each file before any online
correction: a decode step of ROWS rows of CTX tokens each on SMS SMs (``ROWSxCTX@SMS``), a prefill
of N prompts of LEN tokens (``NxLEN@SMS``), and the ratio OLD / NEW. A calibration timed on other
kernels than the server runs shows here as a ratio away from 1 at the shapes that serving sees
(the thirtieth round's stale w8a8 calibration: decode 1.14x slow, docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.spatial.perf_model import ModelCost, PerfModel, PrefillShape

DEFAULT_DECODE = "256x600@132,500x600@132,785x600@108,785x600@68"
DEFAULT_PREFILL = "1x2048@132,8x200@24,16x100@40"


def shapes(spec: str) -> list[tuple[int, int, int]]:
    """``"AxB@S,..."`` as [(A, B, S), ...]."""
    out = []
    for item in spec.split(","):
        size, _, sms = item.strip().partition("@")
        a, _, b = size.partition("x")
        if not (a.isdigit() and b.isdigit() and sms.isdigit()):
            raise ValueError(f"bench calibrations: {item!r} is not COUNTxLENGTH@SMS")
        out.append((int(a), int(b), int(sms)))
    return out


def arch_of(name: str) -> ModelArch:
    return ModelArch.from_hf_dict(PRESETS[name], source=name) if name in PRESETS else ModelArch.from_checkpoint(name)


def compare(old: dict, new: dict, cost: ModelCost, decode: list[tuple[int, int, int]],
            prefill: list[tuple[int, int, int]]) -> list[dict]:
    models = [PerfModel.from_saved(data, cost) for data in (old, new)]
    rows = []
    for batch, ctx, sms in decode:
        ms = [m.decode_ms(batch, batch * ctx, sms) for m in models]
        rows.append({"step": "decode", "shape": f"{batch} rows x {ctx} tokens", "sms": sms,
                     "old_ms": round(ms[0], 3), "new_ms": round(ms[1], 3), "old_over_new": round(ms[0] / ms[1], 3)})
    for prompts, length, sms in prefill:
        shape = PrefillShape.of([length] * prompts)
        ms = [m.prefill_ms(shape, sms) for m in models]
        rows.append({"step": "prefill", "shape": f"{prompts} x {length} tokens", "sms": sms,
                     "old_ms": round(ms[0], 3), "new_ms": round(ms[1], 3), "old_over_new": round(ms[0] / ms[1], 3)})
    return rows


def markdown(rows: list[dict], old: str, new: str) -> str:
    lines = [f"| step | shape | SMs | {old} ms | {new} ms | old / new |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['shape']} | {r['sms']} | {r['old_ms']} | {r['new_ms']} | {r['old_over_new']:.3f}x |"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench calibrations", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="a calibration (perf_model.<gpu>*.yaml)")
    ap.add_argument("new", type=Path, help="another calibration of the same model")
    ap.add_argument("--arch", required=True, help="a preset name (qwen3-30b-a3b, llama-3.1-8b, ...) or a checkpoint")
    ap.add_argument("--fp8-experts", action="store_true", help="the experts read at one byte a weight (quantization=fp8*)")
    ap.add_argument("--fp8-kv", action="store_true", help="K and V cached at one byte (kv.cache_dtype=fp8)")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="the model's bytes a value (default 2: bf16)")
    ap.add_argument("--decode", default=DEFAULT_DECODE, help=f"ROWSxCTX@SMS,... (default {DEFAULT_DECODE})")
    ap.add_argument("--prefill", default=DEFAULT_PREFILL, help=f"PROMPTSxLEN@SMS,... (default {DEFAULT_PREFILL})")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args(argv)
    try:
        decode, prefill = shapes(args.decode), shapes(args.prefill)
    except ValueError as e:
        ap.error(str(e))
    cost = ModelCost.from_arch(arch_of(args.arch), args.dtype_bytes, args.fp8_experts, 1 if args.fp8_kv else None)
    rows = compare(yaml.safe_load(args.old.read_text()), yaml.safe_load(args.new.read_text()), cost, decode, prefill)
    if args.json:
        print(json.dumps({"old": str(args.old), "new": str(args.new), "rows": rows}, indent=1))
    else:
        print(markdown(rows, args.old.name, args.new.name))
    return 0
