"""What a spatial server's prefill ran on over the middle of an iteration log: its batches' SMs,
tokens and windows, and the share of the time a prefill was running.

Bullet's policy gives prefill the fewest SMs that prefill the waiting queue within its TTFT plan
and leaves decode the rest. A prefill kept on a small partition and running most of the time has
no room for a burst of arrivals, which is where a load's TTFT misses come from first: Qwen3-30B-A3B
at 68 req/s on an H200 prefilled on 24 of 132 SMs at the median, 75% of the time (thirtieth
round's log, docs/benchmarks.md, thirty-first round). The ends of the log (ramp-up,
drain) are left out, as in bench/sm_time.py."""
from __future__ import annotations

from bullet_trt.tools.bench.iteration_records import PrefillTimeline, middle_span, step_windows
from bullet_trt.tools.bench.metrics import percentiles


def prefill_partition(records: list[dict], clock: str = "gpu", middle: tuple[float, float] = (0.1, 0.9)) -> dict | None:
    """{"batches", "sms_p50", "sms_p90", "tokens_p50", "tokens_p90", "window_p50_ms", "busy_share"}
    over the prefill steps that started in the `middle` fraction of the log's span; None for a
    log without SM counts (CPU, chunked) or without a prefill step there."""
    if not any(r.get("sms") for r in records):
        return None
    windows = step_windows(records, clock)
    lo, hi = middle_span(windows, middle)
    inside = [(r, (s, e)) for r, (s, e) in zip(records, windows) if r["phase"] == "prefill" and lo <= s < hi]
    if not inside:
        return None
    sms = percentiles((r["sms"] for r, _ in inside), (50, 90))
    tokens = percentiles((r["tokens"] for r, _ in inside), (50, 90))
    window = percentiles(((e - s) * 1e3 for _, (s, e) in inside), (50,))
    return {"batches": len(inside), "sms_p50": sms["p50"], "sms_p90": sms["p90"], "tokens_p50": tokens["p50"],
            "tokens_p90": tokens["p90"], "window_p50_ms": window["p50"],
            "busy_share": PrefillTimeline(records, windows).share(lo, hi)}
