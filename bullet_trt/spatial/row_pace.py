"""The longest decode step beside a prefill that the decoding rows' TPOT can afford
(`serve.row_tpot_budget`).

A request's TPOT is the mean of its gaps between tokens, and every gap is a decode step (the
first also waits out the step in flight when prefill hands the row over). Decode's steps run
long only beside a prefill: on the H100 a fifth of them, at the plan's bound, while the rest
ran alone at 14-15 ms, a mean of 18-19 ms against a 50 ms SLO (docs/benchmarks.md). A bound
per step therefore costs a long request little when set past the SLO, and a request of two or
three tokens a lot: it averages one or two gaps, and one step past the SLO decides it. On
Qwen3-30B-A3B's Azure-code-like load (outputs ~28 tokens) the plan at the SLO failed 82 of the
348 requests under 10 tokens on TPOT where a plan at 0.85 failed 19.

So each row is given what it can spend. A row that may emit `length` tokens, has emitted
`emitted`, the first `since_first_s` ago, keeps its mean within the SLO while its remaining
gaps (one per token left, plus the step in flight for a row not yet stepped) sum to at most

    budget = tpot x (length - 1) - since_first

A prefill of `beside_ms` runs beside decode steps of B each; after it the row's steps take
`later_ms` (the recent mean gap). A row whose budget is below `beside_ms` may spend its whole
remainder beside the prefill, so its gaps must each fit budget / gaps. Otherwise it spends
`beside_ms` on beside_ms / B tokens and the rest at `later_ms`, which fits while

    beside_ms x (1 - later_ms / B) <= budget - gaps x later_ms  (its slack)

so B is free when the slack covers the whole prefill and at most later_ms x beside_ms /
(beside_ms - slack) when it does not. `beside_ms` is the longest the policy plans one batch
to take; a longer prefill (the queue already late) spends more of a row's budget than counted. `length` is the request's max_tokens: exact where the
output runs to it, an upper bound where an end token stops it sooner (then the row could
afford less than this says). A row that could not be kept within the SLO even if every gap
left ran at decode's whole-GPU step is past saving and bounds nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest gap in the mean gap between decode steps: about the last fifty steps,
# a second or so, the time over which the prefills that slow some steps come and go
GAP_WEIGHT = 0.02


@dataclass(frozen=True)
class RowPace:
    length: int  # tokens the request may emit (its max_tokens)
    emitted: int  # tokens out so far, prefill's first included
    since_first_s: float  # time since its first token


def affordable_step_ms(row: RowPace, tpot_ms: float, floor_ms: float, later_ms: float,
                       beside_ms: float) -> float | None:
    """The longest step beside a prefill of ``beside_ms`` that keeps this row's TPOT within
    ``tpot_ms`` (math.inf: any); None when it has no step left, or is past saving (``floor_ms``:
    decode's whole-GPU step)."""
    steps_left = row.length - row.emitted
    if steps_left <= 0 or row.length < 2:
        return None
    gaps = steps_left + (1 if row.emitted <= 1 else 0)  # a row just handed over waits out the step in flight
    budget = tpot_ms * (row.length - 1) - row.since_first_s * 1e3
    if budget < gaps * floor_ms:
        return None
    if budget < beside_ms:
        return budget / gaps
    slack = budget - gaps * later_ms
    if slack >= beside_ms:
        return math.inf
    return later_ms * beside_ms / (beside_ms - slack)


def rows_step_ms(rows: list[RowPace], tpot_ms: float, floor_ms: float, later_ms: float,
                 beside_ms: float) -> float | None:
    """The longest step beside a prefill that every row still within reach affords; None when
    no row bounds it."""
    budgets = [b for b in (affordable_step_ms(r, tpot_ms, floor_ms, later_ms, beside_ms) for r in rows)
               if b is not None]
    bound = min(budgets, default=math.inf)
    return None if math.isinf(bound) else bound


class GapMeter:
    """The mean gap between decode steps as the rows see it (a step's time and the host's
    between steps), over about the last fifty steps; idle spells do not count."""

    def __init__(self, idle_s: float = 1.0):
        self._idle_s = idle_s
        self._last: float | None = None
        self.mean_ms: float | None = None

    def step_done(self, at_s: float) -> None:
        if self._last is not None and at_s - self._last < self._idle_s:
            gap_ms = (at_s - self._last) * 1e3
            self.mean_ms = gap_ms if self.mean_ms is None else self.mean_ms + GAP_WEIGHT * (gap_ms - self.mean_ms)
        self._last = at_s
