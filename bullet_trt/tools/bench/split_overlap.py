"""How disjoint prefill and decode really were, read from an iteration log
(serve.iteration_log): the share of prefill time during which a decode step ran on SMs the
prefill also held, how often the split changed, and where decode steps ran.

    bullet-trt bench overlap iterations.jsonl [--json]

On a GPU each step is the interval between the stamps of the GPU's own clock that the worker
queued before and after it on its stream (gpu_start_ns, gpu_end_ns: one device timer for both
workers); a log without them (CPU, or an older log) falls back to the host's window [t, t +
measured_ms] of one monotonic clock, which also counts launch and synchronize latency. The
report says which clock it used. A prefill on P SMs and a decode step on D SMs share SMs when
P + D exceeds the GPU's SMs (a decode step on the whole GPU always does).

The price of keeping them apart shows in SM-time: from the first prefill's start to the last
one's end, the share of the GPU's SM-seconds that no step held (a prefill waiting for decode's
move, decode still on the complement after a prefill ended) against the share held twice.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys

from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load, step_windows


def _prefill_time_sharing_sms(records: list[dict], windows: list[tuple[float, float]], total: int):
    """(prefill seconds, of which seconds beside a decode step on SMs the prefill also held)."""
    prefills = [(r, w) for r, w in zip(records, windows) if r["phase"] == "prefill"]
    decodes = [(r, w) for r, w in zip(records, windows) if r["phase"] in ("decode", "fused")]
    prefill_s = shared_s = 0.0
    for p, (p0, p1) in prefills:
        prefill_s += p1 - p0
        spans = sorted((max(p0, d0), min(p1, d1)) for d, (d0, d1) in decodes
                       if p["prefill_sms"] + d["decode_sms"] > total)
        end = p0
        for a, b in spans:  # union of the overlapping decode steps inside this prefill
            a = max(a, end)
            if b > a:
                shared_s += b - a
                end = b
    return prefill_s, shared_s


def _sms_running(steps: list[tuple[float, float, int]], starts: list[float], t: float) -> int:
    """SMs of the step running at t among one phase's steps (one at a time, sorted)."""
    k = bisect.bisect_right(starts, t) - 1
    return steps[k][2] if k >= 0 and steps[k][1] > t else 0


def _sm_time_shares(records: list[dict], windows: list[tuple[float, float]], total: int):
    """(share of SM-time no step held, share held twice) between the first prefill's start
    and the last one's end."""
    def steps(phases, key):
        return sorted((w[0], w[1], r[key]) for r, w in zip(records, windows) if r["phase"] in phases)
    prefill, decode = steps(("prefill",), "prefill_sms"), steps(("decode", "fused"), "decode_sms")
    if not prefill or not total:
        return 0.0, 0.0
    t0, t1 = prefill[0][0], max(end for _, end, _ in prefill)
    cuts = sorted({t0, t1, *(t for a, b, _ in prefill + decode for t in (a, b) if t0 < t < t1)})
    prefill_starts, decode_starts = [a for a, _, _ in prefill], [a for a, _, _ in decode]
    idle = twice = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        held = _sms_running(prefill, prefill_starts, mid) + _sms_running(decode, decode_starts, mid)
        idle += max(0, total - held) * (b - a)
        twice += max(0, held - total) * (b - a)
    span = (t1 - t0) * total
    return (idle / span, twice / span) if span > 0 else (0.0, 0.0)


def overlap_report(records: list[dict]) -> dict:
    total = max((max(r.get("prefill_sms", 0), r.get("decode_sms", 0)) for r in records), default=0)
    prefills = [r for r in records if r["phase"] == "prefill"]
    decodes = [r for r in records if r["phase"] in ("decode", "fused")]
    stamped = has_gpu_stamps(records)
    clock = "gpu" if stamped else "host"
    windows = step_windows(records, clock)
    prefill_s, shared_s = _prefill_time_sharing_sms(records, windows, total)
    idle_share, twice_share = _sm_time_shares(records, windows, total)
    splits = [r["prefill_sms"] for r in prefills]
    report = {
        "clock": clock,
        "total_sms": total,
        "prefills": len(prefills),
        "decode_steps": len(decodes),
        "prefill_time_s": round(prefill_s, 4),
        "prefill_time_sharing_sms_s": round(shared_s, 4),
        "prefill_share_sharing_sms": round(shared_s / prefill_s, 4) if prefill_s else 0.0,
        "split_changes": sum(a != b for a, b in zip(splits, splits[1:])),
        "decode_steps_on_whole_gpu": round(sum(d["decode_sms"] == total for d in decodes) / len(decodes), 4)
        if decodes else 0.0,
        "sm_time_idle_share": round(idle_share, 4),
        "sm_time_held_twice_share": round(twice_share, 4),
        "prefill_split_wait_ms_mean": round(sum(p.get("split_wait_ms", 0.0) for p in prefills) / len(prefills), 3)
        if prefills else 0.0,
    }
    if stamped:  # what the host's windows would have said, to show what they add
        host_prefill_s, host_shared_s = _prefill_time_sharing_sms(records, step_windows(records, "host"), total)
        report["host_clock_prefill_share_sharing_sms"] = (round(host_shared_s / host_prefill_s, 4)
                                                         if host_prefill_s else 0.0)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="iteration log (JSONL) written with serve.iteration_log")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = overlap_report(load(args.log))
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
