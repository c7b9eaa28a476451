"""`bullet-trt bench decode-sms`: decode steps against their SMs, read from an iteration log
(serve.iteration_log) with the GPU's stamps.

    bullet-trt bench decode-sms iterations.jsonl[.xz] [--rows-bin 64] [--min-steps 10] [--json]

A split pays when the phase it shrinks loses less time than it gives SMs: a decode step bound by
the weights' and the cache's stream keeps most of its speed on a fraction of the SMs, since a few
of them already draw most of the bandwidth. Whether the engine's decode steps do is in the log of
a served run: steps on a partition of D SMs with no prefill running beside them (after a prefill
ended, before decode moved back) against steps on the whole GPU, at the same rows (bins of
`--rows-bin`). For each pair of groups, the ratio of their median GPU times and of their SM-time
(time x SMs): a time ratio near total / D, an SM-time ratio near 1, is a step whose work scales
with its SMs, and a split then moves SM-time between the phases without saving any of it.
"""
from __future__ import annotations

import statistics
import sys

from bullet_trt.tools.bench.iteration_records import (WITHOUT_A_PREFILL, decode_steps_beside_prefills, load,
                                                      log_reader_parser, print_report)


def decode_sms_report(records: list[dict], rows_bin: int = 64, min_steps: int = 10) -> dict:
    total, steps = decode_steps_beside_prefills(records)
    groups: dict[tuple[int, int], list[float]] = {}
    for step in steps:
        if step.prefill_share <= WITHOUT_A_PREFILL:
            r = step.record
            groups.setdefault((r["decode_sms"], r["batch"] // rows_bin * rows_bin), []).append(step.gpu_ms)
    rows = []
    for (sms, low), times in sorted(groups.items()):
        whole = groups.get((total, low), [])
        if sms == total or len(times) < min_steps or len(whole) < min_steps:
            continue
        ms, whole_ms = statistics.median(times), statistics.median(whole)
        rows.append({"decode_sms": sms, "sm_share": round(sms / total, 3), "rows": f"{low}-{low + rows_bin - 1}",
                     "steps": len(times), "whole_gpu_steps": len(whole), "ms_p50": round(ms, 3),
                     "whole_gpu_ms_p50": round(whole_ms, 3), "time_ratio": round(ms / whole_ms, 3),
                     "sm_time_ratio": round(ms * sms / (whole_ms * total), 3)})
    return {"total_sms": total, "rows_bin": rows_bin, "groups": rows}


def markdown(report: dict) -> str:
    lines = ["| decode SMs (share) | rows | steps on them / on the whole GPU | GPU ms p50 on them | on the whole GPU "
             "| time ratio | SM-time ratio |", "|---|---|---|---|---|---|---|"]
    for r in report["groups"]:
        lines.append(f"| {r['decode_sms']} ({r['sm_share']:.0%}) | {r['rows']} | {r['steps']} / {r['whole_gpu_steps']} "
                     f"| {r['ms_p50']} | {r['whole_gpu_ms_p50']} | {r['time_ratio']:.2f}x | {r['sm_time_ratio']:.2f}x |")
    if not report["groups"]:
        lines.append("| no partition with enough steps beside whole-GPU steps of the same rows | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = log_reader_parser("bullet-trt bench decode-sms", __doc__.split("\n\n")[0])
    ap.add_argument("--rows-bin", type=int, default=64, help="width of the bins of decode rows (default 64)")
    ap.add_argument("--min-steps", type=int, default=10, help="steps each group needs (default 10)")
    args = ap.parse_args(argv)
    return print_report("bench decode-sms", lambda: decode_sms_report(load(args.log), args.rows_bin, args.min_steps),
                        markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
