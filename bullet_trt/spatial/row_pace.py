"""The longest decode step each decoding row's TPOT can still afford (`serve.row_tpot_budget`).

A request's TPOT is the mean of its gaps between tokens, and every gap is a decode step (the
first also waits out the step in flight when prefill hands the row over). A long request
averages hundreds of steps, so a step planned near the TPOT SLO costs it little; a request of
two or three tokens averages one or two, and one step past the SLO decides it. On
Qwen3-30B-A3B's Azure-code-like load (outputs ~28 tokens) the plan at the SLO failed 82 of the
348 requests under 10 tokens on TPOT where a plan at 0.85 failed 19 (docs/benchmarks.md).
So the step beside a prefill is bounded by what the decoding rows can afford: a row that may
emit `length` tokens and has emitted `emitted` of them, the first `since_first_s` ago, keeps
its mean within the SLO while its remaining steps each take at most

    (tpot x (length - 1) - since_first) / (length - emitted [+ 1 for a row not yet stepped])

`length` is the request's max_tokens: exact where the output runs to it, an upper bound where
an end token stops it sooner (then the row could afford less than this says). A row whose
budget is below what decode takes on the whole GPU cannot be kept within the SLO by any split
and does not bind the others.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowPace:
    length: int  # tokens the request may emit (its max_tokens)
    emitted: int  # tokens out so far, prefill's first included
    since_first_s: float  # time since its first token


def affordable_step_ms(row: RowPace, tpot_ms: float) -> float | None:
    """The longest step that keeps this row's TPOT within ``tpot_ms``; None when it has no
    step left to take."""
    steps_left = row.length - row.emitted
    if steps_left <= 0 or row.length < 2:
        return None
    waits = steps_left + (1 if row.emitted <= 1 else 0)  # a row just handed over waits out the step in flight
    return (tpot_ms * (row.length - 1) - row.since_first_s * 1e3) / waits


def rows_step_ms(rows: list[RowPace], tpot_ms: float, floor_ms: float) -> float | None:
    """The longest step all rows that can still be kept within the SLO afford (rows whose
    budget is under ``floor_ms``, decode's whole-GPU step, are past saving); None when no row
    bounds it."""
    budgets = [b for b in (affordable_step_ms(r, tpot_ms) for r in rows) if b is not None and b >= floor_ms]
    return min(budgets) if budgets else None
