"""Sustained request rate: the capacity figure a serving comparison is about.

A configuration sustains rate R when, at R and at every lower rate measured, its SLO
attainment (the mean over repeated runs with different seeds) reaches the target (90% by
default), over the whole run and over the last third of its arrivals alike: a server that
falls behind its arrivals meets the SLOs until its queue has grown, so its whole-run figure
depends on the run's length (bullet_trt/tools/bench/steady_state.py). Its sustained rate is the highest such R among the rates measured; the first
measured rate above it that misses the target bounds its true capacity from above. Ratios
between configurations compare sustained rates, so they are only as fine as the rate grid.

A run interrupted before its requests ended (a stage's time limit, Ctrl-C) measured only part
of its window, its unfinished requests counted as misses: it is left out of its rate's mean
(the report's notes name it). One interrupted after it had sent every request (its drain cut
short) is a lower bound of its attainment: its rate counts as sustained when the mean with
it reaches the target (a lower bound that passes, passes), and is otherwise decided by its
whole runs alone. A run stopped because it was decided (`--stop-when-decided`) is a measured
miss and stays in.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean

DEFAULT_TARGET = 0.9


@dataclass
class Capacity:
    label: str
    dataset: str
    # rate -> attainment of each repeat (fractions), over the whole run and its last third
    attainment: dict[float, list[float]] = field(default_factory=dict)
    tail_attainment: dict[float, list[float]] = field(default_factory=dict)
    sustained: float | None = None  # None: not even the lowest measured rate meets the target
    first_miss: float | None = None  # None: no measured rate misses it
    # rate -> how many of its runs had their drain cut (their attainments are lower bounds,
    # listed after the whole runs' in attainment and tail_attainment)
    lower_bounds: dict[float, int] = field(default_factory=dict)

    def mean_attainment(self, rate: float) -> float:
        return mean(self.attainment[rate])

    def meets(self, rate: float, target: float) -> bool:
        if _meets(self.attainment[rate], self.tail_attainment.get(rate) or [], target):
            return True
        cut = self.lower_bounds.get(rate, 0)
        if not cut:
            return False
        whole = self.attainment[rate][:-cut]
        whole_tail = (self.tail_attainment.get(rate) or [])[:-cut]
        return bool(whole) and _meets(whole, whole_tail, target)


def _meets(attainment: list[float], tail: list[float], target: float) -> bool:
    return mean(attainment) >= target and (not tail or mean(tail) >= target)


def whole_run(doc: dict) -> bool:
    """Whether a result measured its whole window (not interrupted; see the module's note)."""
    return doc.get("stopped_early") != "interrupted"


def drain_cut(doc: dict) -> bool:
    """Whether a result was interrupted after every request had been sent."""
    requests = doc.get("requests") or []
    return (doc.get("stopped_early") == "interrupted" and bool(requests)
            and all(r.get("sent_s") is not None for r in requests))


def capacities(scored: list[tuple[dict, float, float | None]], target: float = DEFAULT_TARGET) -> list[Capacity]:
    """One Capacity per (dataset, label) from (result JSON, its SLO attainment, that of its
    last third of arrivals or None) triples."""
    groups: dict[tuple[str, str], Capacity] = {}
    by_rate: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    tail_by_rate: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    cut_by_rate: dict[tuple[str, str], dict[float, int]] = defaultdict(lambda: defaultdict(int))
    # whole runs first, then those whose drain was cut: Capacity.meets reads the lower bounds
    # as the last entries of each rate's lists
    ordered = [r for r in scored if whole_run(r[0])] + [r for r in scored if drain_cut(r[0])]
    for doc, att, tail in ordered:
        key = (doc["dataset"], doc["label"])
        groups.setdefault(key, Capacity(doc["label"], doc["dataset"]))
        by_rate[key][float(doc["rate"])].append(att)
        if tail is not None:
            tail_by_rate[key][float(doc["rate"])].append(tail)
        if not whole_run(doc):
            cut_by_rate[key][float(doc["rate"])] += 1
    for key, cap in groups.items():
        cap.attainment = {r: by_rate[key][r] for r in sorted(by_rate[key])}
        cap.tail_attainment = {r: tail_by_rate[key][r] for r in cap.attainment if tail_by_rate[key][r]}
        cap.lower_bounds = {r: n for r, n in cut_by_rate[key].items() if n}
        for rate in cap.attainment:
            if cap.meets(rate, target):
                cap.sustained = rate
            else:
                cap.first_miss = rate
                break
    return sorted(groups.values(), key=lambda c: (c.dataset, c.label))


def baseline_for(caps: list[Capacity], dataset: str, prefix: str = "chunked") -> Capacity | None:
    """The strongest configuration of the dataset whose label starts with ``prefix``, or ends
    with it as the mode `bench serve --modes` appends to a label ("moe-chunked-1024-chunked")."""
    rivals = [c for c in caps if c.dataset == dataset
              and (c.label.startswith(prefix) or c.label.endswith(f"-{prefix}"))]
    return max(rivals, key=lambda c: c.sustained or 0.0, default=None)


def ratio_bracket(c: Capacity, base: Capacity) -> str:
    """Where the ratio of the two true edges lies: each edge is at or above its sustained rate
    and below its first miss, so a side without a measured miss leaves that end open ("?")."""
    low = f"{c.sustained / base.first_miss:.2f}x" if base.first_miss else "?"
    high = f"{c.first_miss / base.sustained:.2f}x" if c.first_miss else "?"
    return f"[{low}-{high}]"


def markdown(caps: list[Capacity], target: float = DEFAULT_TARGET) -> str:
    lines = [f"## Sustained rate (mean SLO attainment >= {target:.0%} at that rate and below, "
             "over whole runs and over their last third of arrivals)", "",
             "| dataset | label | sustained (req/s) | first miss (req/s) | vs best chunked [bracket] | "
             "attainment per rate (mean [min-max] over runs) | last third's attainment per rate |",
             "|---|---|---|---|---|---|---|"]
    for c in caps:
        base = baseline_for(caps, c.dataset)
        ratio = "-"
        if base is not None and base.sustained and c.sustained and base is not c:
            ratio = f"{c.sustained / base.sustained:.2f}x {ratio_bracket(c, base)} {base.label}"
        per_rate = "; ".join(
            f"{r:g}: {mean(v):.1%}" + (f" [{min(v):.0%}-{max(v):.0%}] n={len(v)}" if len(v) > 1 else "")
            + (f" ({c.lower_bounds[r]} of them cut in their drain: a lower bound)" if c.lower_bounds.get(r) else "")
            for r, v in c.attainment.items())
        tail = "; ".join(f"{r:g}: {mean(v):.1%}" for r, v in c.tail_attainment.items()) or "-"
        lines.append(f"| {c.dataset} | {c.label} | {'-' if c.sustained is None else f'{c.sustained:g}'} | "
                     f"{'-' if c.first_miss is None else f'{c.first_miss:g}'} | {ratio} | {per_rate} | {tail} |")
    return "\n".join(lines) + "\n"
