"""How much of a GPU's SM-time an iteration log's steps held: each record's window times its
SMs (prefill's partition, or decode's), summed per phase over the middle of the log, against
the GPU's SMs over that span. Near 100%, no host-side change can add throughput at that load:
what is left is the steps' own speed (the H200 at TPOT <= 40 ms and 50 req/s held 97% with the
decode steps launched one ahead, 94% without; 2026-11-27, thirteenth round).

A step that ran on the whole GPU beside a prefill (a split that lagged) counts twice where they
overlap, so a share can pass 100%. The ends of the log (ramp-up, drain) are left out."""
from __future__ import annotations

from bullet_trt.tools.bench.iteration_records import middle_span, step_windows


def sm_time_shares(records: list[dict], clock: str = "gpu", middle: tuple[float, float] = (0.1, 0.9)) -> dict | None:
    """{"prefill": share, "decode": share, "sms": the GPU's SMs} of the SM-time over the
    `middle` fraction of the log's span; None for a log without SM counts (CPU)."""
    total = max((r.get("sms", 0) for r in records), default=0)
    if not total:
        return None
    windows = step_windows(records, clock)
    lo, hi = middle_span(windows, middle)
    held = {"prefill": 0.0, "decode": 0.0}
    for r, (start, end) in zip(records, windows):
        inside = min(end, hi) - max(start, lo)
        if inside > 0:
            held["prefill" if r["phase"] == "prefill" else "decode"] += inside * r["sms"]
    span = (hi - lo) * total
    return {"prefill": held["prefill"] / span, "decode": held["decode"] / span, "sms": total}
