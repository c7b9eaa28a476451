"""The host CPUs one worker of scripts/gpu_lists.sh runs on: this process's allowed CPUs cut into
WORKERS contiguous slices of equal size, slice INDEX printed as `taskset -c` reads it.

    python3 scripts/cpu_slice.py WORKERS INDEX

Prints nothing when there are fewer CPUs than workers (the worker then runs unpinned).

Why: two servers measured side by side on one host share its cores, and a server that starts
(weights built, kernels compiled, graphs captured on every partition) takes many of them for
minutes. Chunked mode's engine loop is one Python thread; beside a starting bullet server on the
other GPU of a machine of two H200s it fell behind and collapsed (31.6% at 64 req/s, the GPU
76% busy), where the same run on the same machine with the neighbour serving held 99.9%
(docs/benchmarks.md, thirty-eighth round). A worker pinned to its own slice keeps a neighbour's
start off its cores.
"""
from __future__ import annotations

import os
import sys


def cpu_slice(cpus: list[int], workers: int, index: int) -> list[int]:
    """Slice `index` of `workers` equal contiguous slices of `cpus` (sorted); [] when the CPUs are
    fewer than the workers. The remainder of an uneven division stays unused by any worker."""
    if workers <= 0 or not 0 <= index < workers:
        raise ValueError(f"index {index} is not one of {workers} workers")
    size = len(cpus) // workers
    ordered = sorted(cpus)
    return ordered[index * size:(index + 1) * size]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    workers, index = int(argv[0]), int(argv[1])
    print(",".join(str(c) for c in cpu_slice(list(os.sched_getaffinity(0)), workers, index)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
