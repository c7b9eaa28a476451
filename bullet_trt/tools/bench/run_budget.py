"""`bench serve --time-budget-s`: whether the next run can end before the command's budget.

A device call or a CI job bounds a sweep from outside; a run cut by that bound measured only
part of its window and is no result (capacity.py), and the minutes it ran are lost. A run is
therefore started only when its arrivals plus a drain (the longest this sweep has seen, a
default before the first) fit in what is left."""
from __future__ import annotations

import time
from dataclasses import dataclass

FIRST_DRAIN_S = 30.0  # before any run has drained: about what one took at the protocol's rates
MARGIN_S = 10.0  # writing the result and rebuilding the report


class BudgetSpent(Exception):
    """The sweep stopped before a run that would not have ended within the budget."""


@dataclass
class RunBudget:
    budget_s: float  # 0: unbounded
    started_at: float | None  # time.monotonic() at the command's start
    longest_drain_s: float = 0.0

    def left_s(self) -> float:
        start = self.started_at if self.started_at is not None else time.monotonic()
        return self.budget_s - (time.monotonic() - start)

    def needs_s(self, arrivals_s: float) -> float:
        return arrivals_s + (self.longest_drain_s or FIRST_DRAIN_S) + MARGIN_S

    def fits(self, arrivals_s: float) -> bool:
        return self.budget_s <= 0 or self.needs_s(arrivals_s) <= self.left_s()

    def why(self, arrivals_s: float) -> str:
        left = max(0.0, self.left_s())
        return (f"it needs ~{self.needs_s(arrivals_s):.0f} s ({arrivals_s:.0f} s of arrivals, a drain, "
                f"{MARGIN_S:.0f} s to write), {left:.0f} s of --time-budget-s {self.budget_s:g} are left")

    def ran(self, doc: dict) -> None:
        """Takes a finished run's drain (its end after its last arrival) into the estimate."""
        duration = (doc.get("summary") or {}).get("duration_s")
        last = (doc.get("workload") or {}).get("last_arrival_s")
        if doc.get("stopped_early") is None and duration is not None and last is not None:
            self.longest_drain_s = max(self.longest_drain_s, duration - last)
