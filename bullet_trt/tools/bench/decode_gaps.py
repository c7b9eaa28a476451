"""How long the GPU waited for the host between decode steps, read from iteration logs
(serve.iteration_log with the GPU clock's stamps):

    bullet-trt bench gaps iterations.jsonl [more logs...] [--json]

A decode worker prepares each step on the host (rows, inputs, sampling state), replays the
step's graph, waits for its tokens, hands them on and books them; the GPU idles for whatever
of that does not overlap a step. A step's GPU window runs from the stamp queued before its
work to the stamp after it, so it holds the host's preparation of the step (the stamp waits
for nothing); the gap is the time from one decode step's end stamp to the next one's start
stamp: host work after a step, or, at small batches mostly, waiting for rows to step at all.
Per band of batch sizes, and per log, so that two codes run on one host (scripts/code_at.sh)
compare side by side: the median and 90th percentile of both, and the gaps' share of the
decode worker's time. (An H100 at 42 req/s, TPOT <= 40 ms: 1.68 ms p50 between steps of
256-511 rows whose windows ran 30.4 ms, 5.6% of the time; 2026-11-26, seventh round's log.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load

BANDS = ((1, 63), (64, 255), (256, 511), (512, 1 << 30))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decode_gaps(records: list[dict]) -> list[dict]:
    """One row per band of batch sizes that has steps: steps, window and gap p50 / p90 (ms),
    and the gaps' share of windows plus gaps. A step's gap is the time to the next decode
    step's start; the last step has none."""
    steps = sorted((r for r in records if r["phase"] in ("decode", "fused")), key=lambda r: r["gpu_start_ns"])
    rows = []
    for low, high in BANDS:
        windows, gaps = [], []
        for step, after in zip(steps, steps[1:] + [None]):
            if not low <= step["batch"] <= high:
                continue
            windows.append((step["gpu_end_ns"] - step["gpu_start_ns"]) / 1e6)
            if after is not None:
                gaps.append((after["gpu_start_ns"] - step["gpu_end_ns"]) / 1e6)
        if not windows:
            continue
        row = {"batch": f"{low}-{high}" if high < 1 << 30 else f"{low}+", "steps": len(windows),
               "window_p50_ms": statistics.median(windows), "window_p90_ms": _quantile(windows, 0.9)}
        if gaps:
            row |= {"gap_p50_ms": statistics.median(gaps), "gap_p90_ms": _quantile(gaps, 0.9),
                    "gap_share": sum(gaps) / (sum(windows[:len(gaps)]) + sum(gaps))}
        rows.append(row)
    return rows


def _line(name: str, row: dict) -> str:
    gap = (f"{row['gap_p50_ms']:8.2f} {row['gap_p90_ms']:8.2f} {100 * row['gap_share']:8.1f}%"
           if "gap_p50_ms" in row else f"{'-':>8} {'-':>8} {'-':>9}")
    return (f"{name:<40} {row['batch']:>9} {row['steps']:>6} {row['window_p50_ms']:8.2f} "
            f"{row['window_p90_ms']:8.2f} {gap}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench gaps", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="iteration logs (.jsonl, .jsonl.gz or .jsonl.xz) written with GPU stamps")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    report = {}
    for path in args.logs:
        records = load(path)
        if not has_gpu_stamps(records):
            print(f"bullet-trt bench gaps: {path} has no GPU clock stamps (a GPU run's log, written with "
                  f"serve.iteration_log, has them)", file=sys.stderr)
            return 2
        report[path] = decode_gaps(records)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{'log':<40} {'batch':>9} {'steps':>6} {'win p50':>8} {'win p90':>8} {'gap p50':>8} {'gap p90':>8} "
          f"{'gap share':>9}   (ms)")
    for path, rows in report.items():
        name = path if len(path) <= 40 else "..." + path[-37:]
        for row in rows:
            print(_line(name, row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
