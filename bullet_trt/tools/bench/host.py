"""The host a serving run ran on, for its result JSON: the engine loop, the workers' step
preparation and the response delivery are Python, so the host's cores set part of a run's
pace. One H100 run (44 req/s, seed 100, the same plan and SM clocks) attained 82.4% in one
round and 62.5% in a later one on another host, with other code between (docs/benchmarks.md,
2026-11-26, seventh round), and nothing said which host each ran on; the result says it now."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_fields() -> dict:
    """``{"host": {...}}``: the CPU model, the cores this process may run on, and all of them."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": {"cpu": cpu_model(), "usable_cores": usable, "cores": os.cpu_count()}}
