"""Decode's plan beside a prefill, tuned by the TPOT that finished requests got
(`serve.tpot_plan_auto`).

The policy bounds decode's step beside a prefill at `tpot_plan` x the TPOT SLO (policy.py).
A request's TPOT is the mean of its gaps, most of which run alone on the whole GPU, so the
bound that serves most depends on the load, the SLO and the GPU. On an H100 with a
ShareGPT-like load the plan at 1.5 sustained 42 req/s at TPOT <= 40 ms, and its misses at 44
were TPOT misses (the bound at the balance of the two SLOs), while at TPOT <= 50 ms the plan at
1.0 still missed on TTFT at 44; on Qwen3-30B-A3B's Azure-code-like load, outputs of ~28 tokens,
the plan at 1.0 failed short requests on TPOT where 0.85 did not (docs/benchmarks.md). A fixed
plan leaves SMs that TTFT needs with decode in one case and spends TPOT it lacks in another.

So the plan follows the requests that end: over the last `window` of them (two tokens or more),
while the `quantile` of their TPOT sits below `low` x the SLO, the plan rises by `step`; above
`high` x the SLO it falls by twice that, looked at once per `interval_s` at most, within [`floor`,
`ceiling`]. Finished requests lag the plan by their lifetime (seconds), hence the small steps,
the dead band between `low` and `high`, and the faster fall: a plan that overshot costs TPOT
misses, which count as much as TTFT ones.
"""
from __future__ import annotations

from collections import deque


class TpotPlanTuner:
    def __init__(self, tpot_slo_ms: float, start: float, *, floor: float = 0.7, ceiling: float = 2.0,
                 quantile: float = 0.9, low: float = 0.8, high: float = 0.9, step: float = 0.05,
                 interval_s: float = 1.0, window: int = 200, min_requests: int = 50):
        if not floor <= start <= ceiling:
            raise ValueError(f"the plan's start {start} lies outside [{floor}, {ceiling}]")
        self.tpot_slo_ms = tpot_slo_ms
        self.value = start
        self.floor, self.ceiling = floor, ceiling
        self.quantile, self.low, self.high, self.step = quantile, low, high, step
        self.interval_s = interval_s
        self.min_requests = min_requests
        self.recent: deque[float] = deque(maxlen=window)
        self._last_look: float | None = None  # when the quantile last decided

    def record(self, tpot_ms: float) -> None:
        """One finished request's TPOT (its mean gap between tokens)."""
        self.recent.append(tpot_ms)

    def recent_quantile(self) -> float | None:
        if len(self.recent) < self.min_requests:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def plan(self, now: float) -> float:
        """The plan for a decision at ``now`` (seconds, monotonic), moved first if due."""
        if self._last_look is not None and now - self._last_look < self.interval_s:
            return self.value
        q = self.recent_quantile()
        if q is None:
            return self.value
        self._last_look = now
        if q < self.low * self.tpot_slo_ms:
            moved = min(self.ceiling, self.value + self.step)
        elif q > self.high * self.tpot_slo_ms:
            moved = max(self.floor, self.value - 2 * self.step)
        else:
            moved = self.value
        self.value = round(moved, 6)
        return self.value
