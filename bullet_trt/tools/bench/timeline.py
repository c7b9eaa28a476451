"""`bullet-trt bench timeline`: a bullet run's two phases over time, and what its prefill batches
cost beside decode, read from an iteration log (serve.iteration_log).

    bullet-trt bench timeline iterations.jsonl[.gz|.xz] [--window 10] [--min-batches 10]
                              [--rows-band 256] [--min-steps 10] [--json]

Where a run fails, the question is which phase ran out first. Per window of `--window` seconds
from the log's first step: the prefill worker's batches (their prompts, tokens, time, its SMs, and
its busy share: the batches' measured time over the window's) and the decode worker's steps
(rows, time, SMs), its fused steps (serve.fuse_prefill: prompts riding in decode's step) with the
share of the window's prompt tokens they prefilled, the most prompts waiting, and the GPU's power
(from NVML's energy counter in the records, else their power readings) with the share of steps
taken under the power cap. A
worker busy near 100% at its SMs is at capacity there; a GPU on its power cap is at capacity
whatever its split.

Then, per prefill SM count, a straight line through the batches that ran beside decode: measured
ms against tokens. Its slope is what a token costs there, its intercept what a batch costs
whatever its size (on an MoE model, about the time to stream every expert beside decode's own
stream); the measured time over the performance model's prediction says how well the split was
planned. With the GPU's stamps in the log, the same for decode: per band of `--rows-band` rows and
per place (on a partition alone or beside a prefill, on the whole GPU alone), the steps' GPU time
over their prediction. Decode's plan keeps TPOT only if that ratio stays near 1 at the rows the
run reached, including rows past those its calibration measured.
"""
from __future__ import annotations

import statistics
import sys

from bullet_trt.tools.bench.energy import energy_between
from bullet_trt.tools.bench.iteration_records import (BESIDE_A_PREFILL, WITHOUT_A_PREFILL,
                                                      decode_steps_beside_prefills, has_gpu_stamps, load,
                                                      log_reader_parser, print_report)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _power(records: list[dict]) -> tuple[float | None, float | None]:
    """The window's mean power (W) and the share of its steps taken under the power cap; None
    where the records carry no reading (a log written on the CPU, or without NVML)."""
    times = [r["t"] for r in records if "energy_j" in r or "power_w" in r]
    joules = energy_between(records, min(times), max(times)) if len(times) >= 2 else None
    if joules is not None and joules > 0:
        watts = joules / (max(times) - min(times))
    else:  # one reading, or a counter that did not move within the window
        watts = _median([r["power_w"] for r in records if "power_w" in r])
    capped = [bool(r["power_capped"]) for r in records if "power_capped" in r]
    return (round(watts, 1) if watts is not None else None,
            round(sum(capped) / len(capped), 3) if capped else None)


def _fused_prompt_tokens(record: dict) -> int | None:
    """The prompt tokens a fused step prefilled: its tokens less its decode rows (None in logs
    written before the record named its prompts)."""
    if "prompts" not in record:
        return None
    return record["tokens"] - (record["batch"] - record["prompts"])


def _fused_share(prefills: list[dict], fused: list[dict]) -> float | None:
    """The share of the window's prompt tokens that rode in decode's steps."""
    riding = [_fused_prompt_tokens(r) for r in fused]
    if None in riding:
        return None
    total = sum(riding) + sum(r["tokens"] for r in prefills)
    return round(sum(riding) / total, 3) if total else None


def windows_report(records: list[dict], window_s: float) -> list[dict]:
    """One row per window that holds a step: each phase's medians and the prefill's busy share."""
    if window_s <= 0:
        raise ValueError(f"--window must be > 0 seconds, got {window_s}")
    t0 = min(r["t"] for r in records)
    by_window: dict[int, list[dict]] = {}
    for r in records:
        by_window.setdefault(int((r["t"] - t0) // window_s), []).append(r)
    rows = []
    for k in sorted(by_window):
        prefills = [r for r in by_window[k] if r["phase"] == "prefill"]
        decodes = [r for r in by_window[k] if r["phase"] == "decode"]
        fused = [r for r in by_window[k] if r["phase"] == "fused"]
        rows.append({
            "start_s": round(k * window_s, 3),
            "prefill_batches": len(prefills),
            "prompts_p50": _median([r["batch"] for r in prefills]),
            "tokens_p50": _median([r["tokens"] for r in prefills]),
            "prefill_ms_p50": _median([r["measured_ms"] for r in prefills]),
            "prefill_sms_p50": _median([r["prefill_sms"] for r in prefills]),
            "prefill_busy": round(sum(r["measured_ms"] for r in prefills) / (window_s * 1e3), 3),
            "decode_steps": len(decodes),
            "rows_p50": _median([r["batch"] for r in decodes]),
            "decode_ms_p50": _median([r["measured_ms"] for r in decodes]),
            "decode_sms_p50": _median([r["decode_sms"] for r in decodes]),
            "fused_steps": len(fused),
            "fused_ms_p50": _median([r["measured_ms"] for r in fused]),
            "prompt_tokens_fused": _fused_share(prefills, fused),
            "waiting_max": max((r.get("waiting", 0) for r in by_window[k]), default=0),
        })
        rows[-1]["gpu_w"], rows[-1]["power_capped"] = _power(by_window[k])
    return rows


def prefill_fits(records: list[dict], min_batches: int) -> list[dict]:
    """Per prefill SM count, the line ms = fixed + per_1000 x tokens / 1000 through the batches
    that ran beside decode (least squares), where at least `min_batches` of them ran and their
    sizes differ."""
    groups: dict[int, list[dict]] = {}
    for r in records:
        if r["phase"] == "prefill" and r.get("decode_sms", 0) > 0:
            groups.setdefault(r["prefill_sms"], []).append(r)
    fits = []
    for sms in sorted(groups):
        batches = groups[sms]
        tokens = [r["tokens"] / 1000 for r in batches]
        if len(batches) < min_batches or len(set(tokens)) < 2:
            continue
        per_1000, fixed = statistics.linear_regression(tokens, [r["measured_ms"] for r in batches])
        ratios = [r["measured_ms"] / r["predicted_ms"] for r in batches if r.get("predicted_ms")]
        fits.append({"prefill_sms": sms, "batches": len(batches), "tokens_p50": _median([r["tokens"] for r in batches]),
                     "ms_per_1000_tokens": round(per_1000, 2), "ms_per_batch": round(fixed, 2),
                     "measured_over_predicted_p50": _median(ratios)})
    return fits


def _decode_place(sms: int, total: int, prefill_share: float) -> str | None:
    """Where a decode step ran, for the steps whose prediction holds one meaning: on the whole GPU
    with no prefill, or on a partition with a prefill beside it for none or all of its window."""
    if sms == total:
        return "whole GPU, alone" if prefill_share <= WITHOUT_A_PREFILL else None
    if prefill_share <= WITHOUT_A_PREFILL:
        return "partition, alone"
    return "partition, beside a prefill" if prefill_share >= BESIDE_A_PREFILL else None


def decode_predictions(records: list[dict], rows_band: int, min_steps: int) -> list[dict]:
    """Per band of rows and place, the decode steps' GPU time (the log's stamps) over the
    performance model's prediction; empty for a log without stamps, whose host windows hold
    launch waits."""
    if rows_band <= 0:
        raise ValueError(f"--rows-band must be > 0 rows, got {rows_band}")
    if not has_gpu_stamps(records):
        return []
    total, steps = decode_steps_beside_prefills(records)
    groups: dict[tuple[int, str], list] = {}
    for step in steps:
        r = step.record
        place = _decode_place(r["decode_sms"], total, step.prefill_share)
        if place and r.get("predicted_ms"):
            groups.setdefault((r["batch"] // rows_band * rows_band, place), []).append(step)
    rows = []
    for (low, place), group in sorted(groups.items()):
        if len(group) < min_steps:
            continue
        rows.append({"rows": f"{low}-{low + rows_band - 1}", "place": place, "steps": len(group),
                     "decode_sms_p50": _median([s.record["decode_sms"] for s in group]),
                     "gpu_ms_p50": _median([s.gpu_ms for s in group]),
                     "predicted_ms_p50": _median([s.record["predicted_ms"] for s in group]),
                     "gpu_over_predicted_p50": _median([s.gpu_ms / s.record["predicted_ms"] for s in group])})
    return rows


def timeline_report(records: list[dict], window_s: float = 10.0, min_batches: int = 10,
                    rows_band: int = 256, min_steps: int = 10) -> dict:
    if not records:
        raise ValueError("the log holds no steps")
    return {"window_s": window_s, "windows": windows_report(records, window_s),
            "prefill_fits": prefill_fits(records, min_batches),
            "gpu_stamps": has_gpu_stamps(records), "rows_band": rows_band,
            "decode_predictions": decode_predictions(records, rows_band, min_steps)}


def _cell(value) -> str:
    return "-" if value is None else f"{value:g}"


def markdown(report: dict) -> str:
    lines = [f"Per {report['window_s']:g} s from the first step (medians of the window's steps):", "",
             "| from s | prefill batches | prompts | tokens | ms | prefill SMs | prefill busy | decode steps | rows "
             "| ms | decode SMs | fused steps | ms | prompt tokens fused | most waiting | GPU W (capped) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in report["windows"]:
        capped = "" if w["power_capped"] is None else f" ({w['power_capped']:.0%})"
        share = "-" if w["prompt_tokens_fused"] is None else f"{w['prompt_tokens_fused']:.0%}"
        lines.append(f"| {w['start_s']:g} | {w['prefill_batches']} | {_cell(w['prompts_p50'])} | {_cell(w['tokens_p50'])} "
                     f"| {_cell(w['prefill_ms_p50'])} | {_cell(w['prefill_sms_p50'])} | {w['prefill_busy']:.0%} "
                     f"| {w['decode_steps']} | {_cell(w['rows_p50'])} | {_cell(w['decode_ms_p50'])} "
                     f"| {_cell(w['decode_sms_p50'])} | {w['fused_steps']} | {_cell(w['fused_ms_p50'])} | {share} "
                     f"| {w['waiting_max']} | {_cell(w['gpu_w'])}{capped} |")
    lines += ["", "Prefill batches beside decode, per prefill SM count (least squares):", "",
              "| prefill SMs | batches | tokens p50 | ms per 1000 tokens | ms per batch | measured / predicted p50 |",
              "|---|---|---|---|---|---|"]
    for f in report["prefill_fits"]:
        lines.append(f"| {f['prefill_sms']} | {f['batches']} | {_cell(f['tokens_p50'])} | {f['ms_per_1000_tokens']} "
                     f"| {f['ms_per_batch']} | {_cell(f['measured_over_predicted_p50'])} |")
    if not report["prefill_fits"]:
        lines.append("| no SM count with enough batches of differing sizes beside decode | | | | | |")
    lines += ["", f"Decode steps against the performance model, per {report['rows_band']} rows (GPU time from the log's stamps):",
              "", "| rows | where | steps | decode SMs p50 | GPU ms p50 | predicted ms p50 | GPU / predicted p50 |",
              "|---|---|---|---|---|---|---|"]
    for d in report["decode_predictions"]:
        lines.append(f"| {d['rows']} | {d['place']} | {d['steps']} | {_cell(d['decode_sms_p50'])} | {_cell(d['gpu_ms_p50'])} "
                     f"| {_cell(d['predicted_ms_p50'])} | {_cell(d['gpu_over_predicted_p50'])} |")
    if not report["decode_predictions"]:
        why = "enough predicted steps in one band and place" if report["gpu_stamps"] else "GPU stamps in the log"
        lines.append(f"| no {why} | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = log_reader_parser("bullet-trt bench timeline", __doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=10.0, help="seconds a row of the timeline spans (default 10)")
    ap.add_argument("--min-batches", type=int, default=10,
                    help="prefill batches an SM count needs for its line (default 10)")
    ap.add_argument("--rows-band", type=int, default=256, help="decode rows a row of the prediction table spans (default 256)")
    ap.add_argument("--min-steps", type=int, default=10, help="decode steps a band and place need for their row (default 10)")
    args = ap.parse_args(argv)
    return print_report("bench timeline", lambda: timeline_report(load(args.log), args.window, args.min_batches,
                                                                  args.rows_band, args.min_steps),
                        markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
