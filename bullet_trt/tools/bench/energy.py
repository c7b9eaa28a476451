"""Output tokens per joule over a run's last third: what a mode gets from the GPU's power.

At their edges on the H200 both serving modes of Qwen3-30B-A3B served about the same output
tokens per joule while one of them drew the 700 W cap and the other ~610 W (docs/benchmarks.md,
thirty-second round): a mode that serves more at the same efficiency only draws more power, and
a capped GPU bounds it. The window is the steady-state one (bullet_trt/tools/bench/steady_state.py),
its tokens spread over each request's streaming as there; its energy comes from the run's GPU
telemetry: NVML's energy counter where the samples carry it, else the sampled power integrated
over time (trapezoids, each sample a reading of NVML's own averaged power).
"""
from __future__ import annotations

from bisect import bisect_left


def _value_at(times: list[float], values: list[float], at: float) -> float:
    """Linear interpolation, held flat beyond the first and last sample."""
    i = bisect_left(times, at)
    if i == 0:
        return values[0]
    if i == len(times):
        return values[-1]
    t0, t1 = times[i - 1], times[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (at - t0) / (t1 - t0) if t1 > t0 else values[i]


def energy_between(samples: list[dict], start_s: float, end_s: float) -> float | None:
    """Joules the GPU used between ``start_s`` and ``end_s`` (seconds on the samples' ``t``), or
    None when the samples do not cover that span."""
    if end_s <= start_s:
        return None
    for key in ("energy_j", "power_w"):
        points = sorted((s["t"], s[key]) for s in samples if key in s and "t" in s)
        if len(points) < 2 or points[0][0] > start_s or points[-1][0] < end_s:
            continue
        times, values = [p[0] for p in points], [p[1] for p in points]
        if key == "energy_j":  # a counter since the driver loaded
            return _value_at(times, values, end_s) - _value_at(times, values, start_s)
        inner = [(t, v) for t, v in points if start_s < t < end_s]
        edge = [(start_s, _value_at(times, values, start_s))] + inner + [(end_s, _value_at(times, values, end_s))]
        return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in zip(edge, edge[1:]))
    return None


def tokens_per_joule(doc: dict, served_tok_s: float, window_s: tuple[float, float]) -> float | None:
    """Output tokens served per joule over ``window_s``, served at ``served_tok_s`` (the
    steady-state figures), or None for a run without telemetry over that window."""
    samples = (doc.get("gpu_telemetry") or {}).get("samples") or []
    start, end = window_s
    joules = energy_between(samples, start, end)
    if joules is None or joules <= 0:
        return None
    return served_tok_s * (end - start) / joules
