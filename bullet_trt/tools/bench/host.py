"""The host a serving run ran on, for its result JSON: the engine loop, the workers' step
preparation and the response delivery are Python, so the host's cores set part of a run's
pace. One H100 run (44 req/s, seed 100, the same plan and SM clocks) attained 82.4% in one
round and 62.5% in a later one on another host, with other code between (docs/benchmarks.md,
2026-11-26, seventh round), and nothing said which host each ran on; the result says it now.
Virtual machines name their CPU alike ("Intel(R) Xeon(R) Processor") whatever runs under it,
so the result also carries the host's measured pace at the kind of Python the engine loop
runs (`python_pace_ns`): the sixth round's code at 44 req/s and seed 100 attained 82.4% on a
host of four H100s and 50.0% on a host of one, at like SM clocks (2026-11-26, eighth round)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def python_pace_ns(rounds: int = 20, items: int = 20_000) -> float:
    """Nanoseconds per item of a loop shaped like the scheduler's bookkeeping (attribute reads,
    dict updates, list appends), the best of `rounds` (the first find a cold core, and a busy
    host's others steal some): lower is a faster host for the engine loop. About 0.05-0.1 s.
    One GPU host gave 104-200 ns across its calls, so a figure means something only beside
    others taken on the same host."""
    class Row:
        __slots__ = ("tokens", "blocks")

        def __init__(self, i: int):
            self.tokens, self.blocks = i, i // 16

    rows = [Row(i) for i in range(items)]
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        seen: dict[int, int] = {}
        out = []
        for row in rows:
            seen[row.blocks] = seen.get(row.blocks, 0) + row.tokens
            if row.tokens & 1:
                out.append(row.tokens + 1)
        best = min(best, (time.perf_counter_ns() - start) / items)
    return best


def host_fields() -> dict:
    """``{"host": {...}}``: the CPU model, the cores this process may run on, all of them, and
    the Python pace (python_pace_ns)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": {"cpu": cpu_model(), "usable_cores": usable, "cores": os.cpu_count(),
                     "python_pace_ns": round(python_pace_ns(), 1)}}
