"""When a sweep may stop measuring a rate: once the runs at that rate can no longer reach the
target SLO attainment on average, whatever the rest of them do (`bench serve
--stop-when-decided`).

A run of N requests with m known misses (requests that failed, got their first token later
than the TTFT SLO, or have waited longer than it without one) ends with an attainment of at
most 1 - m/N. With the attainments of the rate's finished repeats and `left` repeats still to
come (each at most 1), the rate's mean is at most (sum(finished) + 1 - m/N + left) / repeats.
Once that is below the target the rate has failed: the run stops, and the sweep skips the
rate's remaining repeats and every higher rate (a sustained rate needs every lower rate to
meet the target, bullet_trt/tools/bench/capacity.py). TPOT misses are known only when a
request ends and are not counted, so a run is never stopped before its rate has failed. A
finished run's last third of arrivals counts too (`protocol_failed`): a rate is sustained only
when the mean over the runs' last thirds reaches the target as well.

A protocol's seeds may run in separate sweeps, one per GPU at the same time (`--decide-over`):
each sweep then counts the seeds measured elsewhere as runs still to come that meet the SLO
for every request, the most they could add, so that no sweep stops a run that the protocol's
mean could still carry.

A protocol of three seeds x 120 s spent most of its device time on rates above capacity,
measuring how a growing queue drains; this keeps the time for the rates that decide. A sweep
that decides a rate whose other seeds run elsewhere says so (`DECIDED_ELSEWHERE`), so that a
queue of such sweeps (scripts/gpu_lists.sh --queue) can drop the seeds not yet started.
"""
from __future__ import annotations

import math

# Float sums land a hair off exact fractions (3 - 0.9 * 3 is 0.2999...98): every comparison
# leans this far towards going on, so that a rounding error never stops a run that could pass.
_SLACK = 1e-9

# Printed after a run that decides its rate for the seeds other sweeps would measure; the GPU
# job queue (scripts/gpu_lists.sh) matches it
DECIDED_ELSEWHERE = "decided whatever the protocol's other seeds attain"


def misses_that_decide(num_requests: int, finished: list[float], left: int, target: float) -> int | None:
    """The known misses at which the run now measured decides that its rate failed; 0 when the
    finished repeats have decided it already; None when this run cannot decide it alone."""
    repeats = len(finished) + 1 + left
    may_miss = sum(finished) + 1 + left - target * repeats  # fraction of this run's requests
    if may_miss < -_SLACK:
        return 0
    if may_miss >= 1:
        return None
    return math.floor(may_miss * num_requests + num_requests * _SLACK) + 1


def rate_failed(finished: list[float], left: int, target: float) -> bool:
    """True when the repeats measured so far keep the rate's mean below the target even if
    every repeat left meets the SLO for all its requests."""
    return (sum(finished) + left) / (len(finished) + left) < target - _SLACK


def protocol_failed(finished: list[float], tails: list[float], left: int, target: float) -> bool:
    """True when the rate can no longer be sustained (bullet_trt/tools/bench/capacity.py):
    either its mean attainment or the mean over its runs' last thirds of arrivals stays below
    the target even if every repeat left scores 100% on both. A run that ends with its queue
    grown (say 72% over the run, 15% over its last third) decides the rate by its last third,
    which the whole-run mean alone would leave open to two perfect seeds."""
    return rate_failed(finished, left, target) or (bool(tails) and rate_failed(tails, left, target))


def runs_to_come(keys: list, n: int, elsewhere: int) -> int:
    """The runs of run ``n``'s key (dataset, rate) not yet measured: those after it in this
    sweep and ``elsewhere``, the protocol's seeds that other sweeps measure."""
    return sum(1 for key in keys[n + 1:] if key == keys[n]) + elsewhere
