"""Decode's plan beside a prefill, tuned to leave TTFT and TPOT the same headroom
(`serve.tpot_plan_auto`).

The policy bounds decode's step beside a prefill at `tpot_plan` x the TPOT SLO (policy.py): a
higher plan gives prefill more SMs (TTFT) and decode's steps beside it more time (TPOT). Which
plan serves most depends on the load, the SLO and the GPU. On an H100 with a ShareGPT-like load
1.5 sustained 42 req/s at TPOT <= 40 ms, its misses at 44 on TPOT, while 1.0 sustained 40 at
TPOT <= 50 ms, its misses at 44 on TTFT (docs/benchmarks.md): each at the point where the two
SLOs bind together.

So the plan moves toward that point. Every `interval_s` it compares the two SLOs' pressures: the
`quantile` of the recent first tokens' TTFT (or the age of the oldest prompt still waiting, if
larger: a backlog shows there before any of its requests has a token) over the TTFT SLO, and the
`quantile` of the recently finished requests' TPOT over the TPOT SLO. When one exceeds the other
by more than `band`, and either exceeds `busy` (below that neither SLO is near, and nothing needs
trading), the plan moves a `step` toward the one under pressure, two steps when they differ by
more than 0.5, within [`floor`, `ceiling`].

The tuner's first version moved on TPOT alone (up below 0.8 of the SLO, down above 0.9). On the
H100 at TPOT <= 40 ms, where a sustained rate's TPOT sits near 0.9 of the SLO, it lowered the
plan until prefill starved and TTFT ran to 10-12 s at 42 req/s, which the plan at 1.5 sustains
(2026-11-26, seventh round).
"""
from __future__ import annotations

from collections import deque

import numpy as np


def _quantile(values: deque[float], q: float) -> float:
    # the smallest observed value at or above the quantile: a pressure the window has seen
    return float(np.quantile(np.fromiter(values, dtype=float), q, method="higher"))


class TpotPlanTuner:
    def __init__(self, ttft_slo_ms: float, tpot_slo_ms: float, start: float, *, floor: float = 0.7,
                 ceiling: float = 2.0, quantile: float = 0.9, busy: float = 0.6, band: float = 0.15,
                 step: float = 0.05, interval_s: float = 1.0, window: int = 200, min_requests: int = 50):
        if not floor <= start <= ceiling:
            raise ValueError(f"the plan's start {start} lies outside [{floor}, {ceiling}]")
        self.ttft_slo_ms, self.tpot_slo_ms = ttft_slo_ms, tpot_slo_ms
        self.value = start
        self.floor, self.ceiling = floor, ceiling
        self.quantile, self.busy, self.band, self.step = quantile, busy, band, step
        self.interval_s = interval_s
        self.min_requests = min_requests
        self.ttfts: deque[float] = deque(maxlen=window)
        self.tpots: deque[float] = deque(maxlen=window)
        self._last_look: float | None = None  # when the pressures last decided

    def record_ttft(self, ttft_ms: float) -> None:
        """One request's time to its first token."""
        self.ttfts.append(ttft_ms)

    def record_tpot(self, tpot_ms: float) -> None:
        """One finished request's TPOT (its mean gap between tokens)."""
        self.tpots.append(tpot_ms)

    def pressures(self, oldest_wait_ms: float = 0.0) -> tuple[float, float] | None:
        """(TTFT's, TPOT's): each SLO's recent quantile as a share of it; None until both
        signals have `min_requests`."""
        if len(self.ttfts) < self.min_requests or len(self.tpots) < self.min_requests:
            return None
        ttft = max(_quantile(self.ttfts, self.quantile), oldest_wait_ms)
        return ttft / self.ttft_slo_ms, _quantile(self.tpots, self.quantile) / self.tpot_slo_ms

    def plan(self, now: float, oldest_wait_ms: float = 0.0) -> float:
        """The plan for a decision at ``now`` (seconds, monotonic), moved first if due;
        ``oldest_wait_ms``: how long the oldest prompt still waiting has waited."""
        if self._last_look is not None and now - self._last_look < self.interval_s:
            return self.value
        seen = self.pressures(oldest_wait_ms)
        if seen is None:
            return self.value
        self._last_look = now
        ttft, tpot = seen
        gap = ttft - tpot
        if max(ttft, tpot) < self.busy or abs(gap) <= self.band:
            return self.value
        steps = 2 if abs(gap) > 0.5 else 1
        moved = self.value + steps * self.step if gap > 0 else self.value - steps * self.step
        self.value = round(min(self.ceiling, max(self.floor, moved)), 6)
        return self.value
