"""Draws the SM-split timeline of a per-iteration JSONL log, with the queue lengths under it.

    bullet-trt plot iterations.jsonl -o split.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(records: list[dict], out: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("no iteration records to plot")
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6),
                                      gridspec_kw={"height_ratios": [2, 1]})
    # a fused step is decode's step with prompts riding along: on decode's SMs
    for phase, color in (("prefill", "tab:orange"), ("fused", "tab:red"), ("decode", "tab:blue")):
        rows = [r for r in records if r["phase"] == phase]
        if rows:
            # Each iteration is a bar from its start, as long as it ran, as tall as its SMs.
            top.bar([r["t"] for r in rows], [r["sms"] for r in rows],
                    width=[r["measured_ms"] / 1e3 for r in rows], align="edge",
                    color=color, alpha=0.6, label=f"{phase} SMs")
    top.set_ylabel("SMs per iteration")
    top.legend(loc="upper right")
    top.set_title(title or "SM split per iteration")
    ts = [r["t"] for r in records]
    for key, color in (("waiting", "tab:red"), ("decoding", "tab:blue"), ("prefilling", "tab:orange")):
        bottom.step(ts, [r.get(key, 0) for r in records], where="post", color=color, label=key)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("time since start (s)")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="JSONL written with serve.iteration_log")
    ap.add_argument("-o", "--out", default="sm_split.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    print(plot(load(args.log), args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
