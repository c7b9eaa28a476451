"""`bullet-trt bench <kind>`: kernels (GPU ceilings and the engine against them), moe (the fused
mixture-of-experts kernels and an MoE engine against them), moe-tune (the fused MoE kernels'
tile table for this GPU), serve (load
generator against a running server), hf-peer (transformers' continuous batching on the same
workload), decode-profile (where a decode step's time goes), decode-overlap (the decode
worker's steps one at a time against launched one ahead), steps-ahead (chunked mode's steps
one at a time against launched one ahead), overlap (how disjoint prefill and
decode were, from an iteration log), tp (the all-reduce and the decode step over N GPUs),
mixed-step (chunked mode's mixed step, eager against piecewise CUDA graphs), steady (whether
serving runs kept up with their arrivals, window by window), misses (a run's SLO misses by
cause and output length), gaps (how long the GPU waited for the host between decode steps, from
iteration logs), host-step (the host's share of a graphed decode step against the code before,
on this CPU), interference (what a prefill beside them cost decode steps on their own partition,
from an iteration log), decode-sms (decode steps' GPU time and SM-time on a partition against the
whole GPU at the same rows, from an iteration log), timeline (a bullet run's two phases window by
window, and its prefill batches' cost per token and per batch beside decode, from an iteration
log), calibrations (two calibrations' predictions of the same steps side by side)."""
from __future__ import annotations

import importlib
import sys

KINDS = {
    "kernels": "bullet_trt.tools.bench.kernel_bench",
    "moe": "bullet_trt.tools.bench.moe_bench",
    "moe-tune": "bullet_trt.tools.bench.moe_tune",
    "serve": "bullet_trt.tools.bench.serve_bench",
    "hf-peer": "bullet_trt.tools.bench.hf_peer",
    "decode-profile": "bullet_trt.tools.bench.decode_profile",
    "decode-overlap": "bullet_trt.tools.bench.decode_overlap",
    "steps-ahead": "bullet_trt.tools.bench.steps_ahead",
    "overlap": "bullet_trt.tools.bench.split_overlap",
    "tp": "bullet_trt.tools.bench.tp_bench",
    "mixed-step": "bullet_trt.tools.bench.mixed_step",
    "steady": "bullet_trt.tools.bench.steady_state",
    "misses": "bullet_trt.tools.bench.misses",
    "gaps": "bullet_trt.tools.bench.decode_gaps",
    "host-step": "bullet_trt.tools.bench.host_step",
    "interference": "bullet_trt.tools.bench.interference",
    "decode-sms": "bullet_trt.tools.bench.decode_sms",
    "timeline": "bullet_trt.tools.bench.timeline",
    "calibrations": "bullet_trt.tools.bench.calibration_diff",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in KINDS:
        print(f"usage: bullet-trt bench {{{','.join(KINDS)}}} [options]\n{__doc__}", file=sys.stderr)
        return 2
    return int(importlib.import_module(KINDS[argv[0]]).main(argv[1:]) or 0)
