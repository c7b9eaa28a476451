"""Draws the SM-split timeline of a per-iteration JSONL log, with the queue lengths under it.

    bullet-trt plot iterations.jsonl[.gz] -o split.png [--from S --to S]

Each step is a bar as wide as it ran and as tall as its SMs, on the GPU's own clock where the
log has its stamps (a GPU run with serve.iteration_log), else on the host's; --from/--to zoom
into seconds of that clock, where single steps can be told apart. A server with
serve.tpot_plan_auto also has its decode plan drawn over time beside the queues.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bullet_trt.tools.bench.iteration_records import has_gpu_stamps, load, step_windows


def plot(records: list[dict], out: str | Path, title: str = "", start: float | None = None,
         end: float | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("no iteration records to plot")
    clock = "gpu" if has_gpu_stamps(records) else "host"
    total = max(r["sms"] for r in records)
    windows = step_windows(records, clock)
    shown = [(r, w) for r, w in zip(records, windows)
             if (start is None or w[1] >= start) and (end is None or w[0] <= end)]
    if not shown:
        raise ValueError(f"no iteration in the window [{start}, {end}] s")
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6),
                                      gridspec_kw={"height_ratios": [2, 1]})
    # a fused step is decode's step with prompts riding along: on decode's SMs
    for phase, color in (("prefill", "tab:orange"), ("fused", "tab:red"), ("decode", "tab:blue")):
        rows = [(r, w) for r, w in shown if r["phase"] == phase]
        if rows:
            # prefill's partition drawn from SM 0 up, decode's from the top down: bars that
            # overlap are steps that shared SMs
            top.bar([w[0] for _, w in rows], [r["sms"] for r, _ in rows],
                    bottom=[0 if phase == "prefill" else total - r["sms"] for r, _ in rows],
                    width=[w[1] - w[0] for _, w in rows], align="edge",
                    color=color, alpha=0.6, label=f"{phase} SMs")
    top.set_ylabel("SMs (prefill from 0, decode from the top)")
    top.legend(loc="upper right")
    top.set_title(title or "SM split per iteration")
    ts = [w[0] for _, w in shown]
    for key, color in (("waiting", "tab:red"), ("decoding", "tab:blue"), ("prefilling", "tab:orange")):
        bottom.step(ts, [r.get(key, 0) for r, _ in shown], where="post", color=color, label=key)
    bottom.set_ylabel("requests")
    plan_ts, plans = plan_series(shown)
    if plans:  # serve.tpot_plan_auto: the plan each prefill's decode steps ran under
        right = bottom.twinx()
        right.step(plan_ts, plans, where="post", color="black", label="decode plan (x TPOT SLO)")
        right.set_ylabel("decode plan (x TPOT SLO)")
        right.legend(loc="upper left")
    bottom.set_xlabel("GPU clock (s since the first step)" if clock == "gpu" else "time since start (s)")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plan_series(shown: list[tuple[dict, tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """(start, plan) of each shown prefill record that names its decode plan."""
    pairs = [(w[0], r["tpot_plan"]) for r, w in shown if r.get("tpot_plan") is not None]
    return [t for t, _ in pairs], [p for _, p in pairs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="JSONL written with serve.iteration_log")
    ap.add_argument("-o", "--out", default="sm_split.png")
    ap.add_argument("--title", default="")
    ap.add_argument("--from", dest="start", type=float, default=None, help="first second shown")
    ap.add_argument("--to", dest="end", type=float, default=None, help="last second shown")
    args = ap.parse_args(argv)
    print(plot(load(args.log), args.out, args.title, args.start, args.end))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
