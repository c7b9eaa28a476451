"""`bullet-trt bench interference`: what a prefill running beside them cost the decode steps on
their own partition, read from an iteration log (serve.iteration_log) with the GPU's stamps.

    bullet-trt bench interference iterations.jsonl[.xz] [--min-steps 20] [--json]

A spatial split gains only as far as its two partitions run as if each had its SMs alone. A
decode step on D SMs while a prefill runs on the others has its own SMs but shares the memory
system and the power budget with the prefill; a step on the same D SMs with no prefill running
(after a prefill ended, before decode moved back) has the GPU to itself. Grouped by decode SMs
and rows (buckets of powers of two), the median GPU time of the steps that had a prefill beside
them for their whole window, against the steps that had none: their ratio is what sharing the
GPU cost decode. The rows' medians are printed beside, since the two kinds of steps come at
different moments of a run. Steps on the whole GPU with a prefill running share SMs with it
(each waits for the other's blocks); they are a group of their own.
"""
from __future__ import annotations

import statistics
import sys

from bullet_trt.tools.bench.iteration_records import (BESIDE_A_PREFILL, WITHOUT_A_PREFILL, decode_steps_beside_prefills,
                                                      load, log_reader_parser, print_report)


def _bucket(rows: int) -> int:
    return 1 << (max(rows, 1).bit_length() - 1)


def interference_report(records: list[dict], min_steps: int = 20) -> dict:
    total, steps = decode_steps_beside_prefills(records)
    groups: dict[tuple[int, int], dict[str, list[tuple[float, int]]]] = {}
    for step in steps:
        share = step.prefill_share
        kind = "beside" if share >= BESIDE_A_PREFILL else "alone" if share <= WITHOUT_A_PREFILL else None
        if kind is None:
            continue
        r = step.record
        group = groups.setdefault((r["decode_sms"], _bucket(r["batch"])), {"beside": [], "alone": []})
        group[kind].append((step.gpu_ms, r["batch"]))
    rows = []
    for (sms, bucket), kinds in sorted(groups.items()):
        beside, alone = kinds["beside"], kinds["alone"]
        if len(beside) < min_steps or len(alone) < min_steps:
            continue
        beside_ms = statistics.median(ms for ms, _ in beside)
        alone_ms = statistics.median(ms for ms, _ in alone)
        rows.append({"decode_sms": sms, "rows": f"{bucket}-{2 * bucket - 1}", "shares_sms": sms >= total,
                     "alone_steps": len(alone), "beside_steps": len(beside),
                     "alone_rows_p50": statistics.median(n for _, n in alone),
                     "beside_rows_p50": statistics.median(n for _, n in beside),
                     "alone_ms_p50": round(alone_ms, 3), "beside_ms_p50": round(beside_ms, 3),
                     "beside_over_alone": round(beside_ms / alone_ms, 3)})
    partition = [r for r in rows if not r["shares_sms"]]
    weight = sum(r["beside_steps"] for r in partition)
    return {"total_sms": total, "groups": rows,
            "partition_beside_over_alone": round(sum(r["beside_over_alone"] * r["beside_steps"] for r in partition)
                                                 / weight, 3) if weight else None}


def markdown(report: dict) -> str:
    lines = ["| decode SMs | rows | steps alone / beside a prefill | rows p50 alone / beside | GPU ms p50 alone | "
             "GPU ms p50 beside | beside / alone |", "|---|---|---|---|---|---|---|"]
    for r in report["groups"]:
        sms = f"{r['decode_sms']} (shares SMs with the prefill)" if r["shares_sms"] else str(r["decode_sms"])
        lines.append(f"| {sms} | {r['rows']} | {r['alone_steps']} / {r['beside_steps']} | "
                     f"{r['alone_rows_p50']:g} / {r['beside_rows_p50']:g} | {r['alone_ms_p50']} | "
                     f"{r['beside_ms_p50']} | {r['beside_over_alone']:.2f}x |")
    overall = report["partition_beside_over_alone"]
    lines += ["", "on a partition of their own, weighted by the steps beside a prefill: "
              + (f"{overall:.2f}x" if overall is not None else "no group with enough steps of both kinds")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = log_reader_parser("bullet-trt bench interference", __doc__.split("\n\n")[0])
    ap.add_argument("--min-steps", type=int, default=20, help="steps of each kind a group needs (default 20)")
    args = ap.parse_args(argv)
    return print_report("bench interference", lambda: interference_report(load(args.log), args.min_steps),
                        markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
