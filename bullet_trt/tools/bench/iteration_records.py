"""The records of an iteration log (serve.iteration_log, one JSON object per prefill batch or
decode step) and each step's window in time, for the tools that read such a log."""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bullet_trt.tools.bench.kept_files import open_kept


def load(path: str | Path) -> list[dict]:
    """The log's records; a path ending in .gz or .xz is read through gzip or lzma."""
    with open_kept(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def has_gpu_stamps(records: list[dict]) -> bool:
    return bool(records) and all("gpu_start_ns" in r for r in records)


def step_windows(records: list[dict], clock: str) -> list[tuple[float, float]]:
    """Each record's (start, end) in seconds on `clock`: "gpu" (its stamps of the GPU's own
    timer, from the first stamp) or "host" (its host window [t, t + measured_ms])."""
    if clock == "gpu":
        t0 = min(r["gpu_start_ns"] for r in records)  # integers first: ns since an epoch overflow a float's precision
        return [((r["gpu_start_ns"] - t0) / 1e9, (r["gpu_end_ns"] - t0) / 1e9) for r in records]
    return [(r["t"], r["t"] + r["measured_ms"] / 1e3) for r in records]


def middle_span(windows: list[tuple[float, float]], middle: tuple[float, float]) -> tuple[float, float]:
    """The ``middle`` fraction (e.g. (0.1, 0.9)) of the span the windows cover: a log's steady part,
    without its ramp-up and drain."""
    first, last = min(s for s, _ in windows), max(e for _, e in windows)
    return first + (last - first) * middle[0], first + (last - first) * middle[1]


class PrefillTimeline:
    """The prefill steps' windows of a log (one prefill at a time), to tell how much of another
    step's window a prefill ran in."""

    def __init__(self, records: list[dict], windows: list[tuple[float, float]]):
        self.spans = sorted(w for r, w in zip(records, windows) if r["phase"] == "prefill")
        self.starts = [a for a, _ in self.spans]

    def share(self, a: float, b: float) -> float:
        """Share of [a, b] during which a prefill ran."""
        k = bisect.bisect_right(self.starts, b) - 1
        covered = 0.0
        while k >= 0 and self.spans[k][1] > a:
            covered += max(0.0, min(b, self.spans[k][1]) - max(a, self.spans[k][0]))
            k -= 1
        return covered / (b - a) if b > a else 0.0


# the share of a decode step's window a prefill ran in: beside one for all of it, or for none
BESIDE_A_PREFILL, WITHOUT_A_PREFILL = 0.95, 0.01


@dataclass
class TimedDecodeStep:
    record: dict
    gpu_ms: float
    prefill_share: float  # of its window, a prefill running on the other SMs (or the same)


def decode_steps_beside_prefills(records: list[dict]) -> tuple[int, list[TimedDecodeStep]]:
    """The GPU's SMs (the most a decode step ran on) and every decode step with its GPU time and
    the share of its window a prefill ran in. A log without the GPU's stamps is a ValueError: its
    host windows hold launch waits, which would pass for the GPU's own time."""
    if not has_gpu_stamps(records):
        raise ValueError("the log has no GPU stamps (gpu_start_ns): the host's windows hold launch waits")
    windows = step_windows(records, "gpu")
    prefills = PrefillTimeline(records, windows)
    total = max(r.get("decode_sms", 0) for r in records)
    return total, [TimedDecodeStep(r, (b - a) * 1e3, prefills.share(a, b))
                   for r, (a, b) in zip(records, windows) if r["phase"] == "decode"]


def log_reader_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments every reader of one GPU-stamped iteration log takes: the log and --json."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("log", help="iteration log (JSONL, or .xz) written with serve.iteration_log on a GPU")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def print_report(prog: str, build: Callable[[], dict], render: Callable[[dict], str], as_json: bool) -> int:
    """Prints a reader's report, as JSON or rendered; a log it cannot read is exit status 2 and
    the reason on stderr."""
    try:
        report = build()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report) if as_json else render(report))
    return 0
