"""How long the GPU waited for the host between decode steps, read from iteration logs
(serve.iteration_log):

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
A log without the GPU's stamps (CPU, or one written before them) is read on the host's clock
instead, each step's window [t, t + measured_ms], which also counts the launch and the wait
for the step's end; the report names the clock.

Under the table, per log, the share of the GPU's SM-time its steps held (bench/sm_time.py) and, for a
spatial server, what its prefill ran on: SMs, tokens, and how much of the time (bench/prefill_partition.py).

The "at split" column: the part of the gaps' time that came before a step on another split
than the one before it (a change of SM split, which the overlapped loop drained until the
thirteenth round of 2026-11-27, 2.9 ms each).

Chunked mode's log (engine/step_log.py) is read the same way: its steps, "decode" alone or
"mixed" with prompt chunks, are the steps between which the GPU may wait; its records name no
SMs, so no SM-time line.

Steps launched one ahead (decode.overlap_steps) log their launch's host time too: the launch
p50 column. It should be a small part of the window; near the whole window, each launch waited
for its own step on the device and the gaps are what the plain loop's would be (2026-11-27,
twelfth round: the banned-token mask's host synchronize, `bench decode-overlap` names such calls).
The "launch>win" column is the share of those steps whose launch took longer than their window:
where it is large and the gaps grow, the host sets the pace.

`--phase mixed` (or decode, fused) reports only the steps of that phase, each still measured
to the next step of any phase: chunked's mixed steps apart from its decode steps, whose launches
(eager attention between piecewise graphs against one graph) cost the host very differently.
(Chunked-1024 one ahead at 40 req/s on an H200, TPOT <= 40 ms: mixed steps of 256-511 rows
launched in 24.4 ms p50 against 29.7 ms windows, 0.01 ms between steps; 2026-11-27, seventeenth
round's log.)
"""
from __future__ import annotations

import argparse
import json
import sys

from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load, step_windows
from bullet_trt.tools.bench.metrics import percentiles
from bullet_trt.tools.bench.prefill_partition import prefill_partition
from bullet_trt.tools.bench.sm_time import sm_time_shares

BANDS = ((1, 63), (64, 255), (256, 511), (512, 1 << 30))


STEP_PHASES = ("decode", "fused", "mixed")  # mixed: chunked's steps with prompt chunks


def decode_gaps(records: list[dict], clock: str = "gpu", phase: str | None = None) -> list[dict]:
    """One row per band of batch sizes that has steps: steps, window and gap p50 / p90 (ms),
    and the gaps' share of windows plus gaps, on `clock` ("gpu" or "host", as
    iteration_records.step_windows). A step's gap is the time to the next decode step's start;
    the last step has none. `phase`: report only that phase's steps (gaps still run to the next
    step of any phase)."""
    timed = [(r, w) for r, w in zip(records, step_windows(records, clock)) if r["phase"] in STEP_PHASES]
    timed.sort(key=lambda rw: rw[1][0])
    rows = []
    for low, high in BANDS:
        windows, gaps, launches, launch_over, at_split = [], [], [], 0, 0.0
        for (step, (start, end)), after in zip(timed, timed[1:] + [None]):
            if not low <= step["batch"] <= high or phase not in (None, step["phase"]):
                continue
            windows.append((end - start) * 1e3)
            if "launch_ms" in step:
                launches.append(step["launch_ms"])
                launch_over += step["launch_ms"] > windows[-1]
            if after is not None:
                gaps.append((after[1][0] - end) * 1e3)
                if after[0].get("decode_sms") != step.get("decode_sms"):
                    at_split += gaps[-1]
        if not windows:
            continue
        window = percentiles(windows, (50, 90))
        row = {"batch": f"{low}-{high}" if high < 1 << 30 else f"{low}+", "steps": len(windows),
               "window_p50_ms": window["p50"], "window_p90_ms": window["p90"]}
        if gaps:
            gap = percentiles(gaps, (50, 90))
            idle = sum(gaps)
            row |= {"gap_p50_ms": gap["p50"], "gap_p90_ms": gap["p90"],
                    "gap_share": idle / (sum(windows[:len(gaps)]) + idle),
                    "gap_at_split_share": at_split / idle if idle > 0 else 0.0}
        if launches:
            row["launch_p50_ms"] = percentiles(launches, (50,))["p50"]
            row["launch_over_window_share"] = launch_over / len(launches)
        rows.append(row)
    return rows


def _line(name: str, row: dict) -> str:
    gap = (f"{row['gap_p50_ms']:8.2f} {row['gap_p90_ms']:8.2f} {100 * row['gap_share']:8.1f}% "
           f"{100 * row['gap_at_split_share']:7.0f}%"
           if "gap_p50_ms" in row else f"{'-':>8} {'-':>8} {'-':>9} {'-':>8}")
    launch = (f"{row['launch_p50_ms']:10.2f} {100 * row['launch_over_window_share']:9.1f}%"
              if "launch_p50_ms" in row else f"{'-':>10} {'-':>10}")
    return (f"{name:<40} {row['batch']:>9} {row['steps']:>6} {row['window_p50_ms']:8.2f} "
            f"{row['window_p90_ms']:8.2f} {gap} {launch}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench gaps", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="iteration logs (.jsonl, .jsonl.gz or .jsonl.xz)")
    ap.add_argument("--phase", choices=STEP_PHASES, help="report only this phase's steps (default: all)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    report = {}
    for path in args.logs:
        records = load(path)
        clock = "gpu" if has_gpu_stamps(records) else "host"
        report[path] = {"clock": clock, "bands": decode_gaps(records, clock, args.phase),
                        "sm_time": sm_time_shares(records, clock), "prefill": prefill_partition(records, clock)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{'log':<40} {'batch':>9} {'steps':>6} {'win p50':>8} {'win p90':>8} {'gap p50':>8} {'gap p90':>8} "
          f"{'gap share':>9} {'at split':>8} {'launch p50':>10} {'launch>win':>10}   (ms)")
    for path, read in report.items():
        name = path if len(path) <= 40 else "..." + path[-37:]
        for row in read["bands"]:
            print(_line(name, row) + ("" if read["clock"] == "gpu" else "   (host clock)"))
        if read["sm_time"]:
            held = read["sm_time"]
            print(f"{name:<40} SM-time held over the middle 80% of the log: prefill {100 * held['prefill']:.1f}%, "
                  f"decode {100 * held['decode']:.1f}% of {held['sms']} SMs (bench/sm_time.py)")
        if read["prefill"]:
            pre = read["prefill"]
            print(f"{name:<40} prefill over the middle 80%: {pre['batches']} batches on {pre['sms_p50']:.0f} SMs p50 "
                  f"({pre['sms_p90']:.0f} p90), {pre['tokens_p50']:.0f} tokens p50 ({pre['tokens_p90']:.0f} p90), "
                  f"{pre['window_p50_ms']:.1f} ms p50, running {100 * pre['busy_share']:.1f}% of the time "
                  f"(bench/prefill_partition.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
