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
(the report's notes name it). A run stopped because it was decided (`--stop-when-decided`)
is a measured miss and stays in.
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

    def mean_attainment(self, rate: float) -> float:
        return mean(self.attainment[rate])

    def meets(self, rate: float, target: float) -> bool:
        tail = self.tail_attainment.get(rate) or []
        return self.mean_attainment(rate) >= target and (not tail or mean(tail) >= target)


def whole_run(doc: dict) -> bool:
    """Whether a result measured its whole window (not interrupted; see the module's note)."""
    return doc.get("stopped_early") != "interrupted"


def capacities(scored: list[tuple[dict, float, float | None]], target: float = DEFAULT_TARGET) -> list[Capacity]:
    """One Capacity per (dataset, label) from (result JSON, its SLO attainment, that of its
    last third of arrivals or None) triples."""
    groups: dict[tuple[str, str], Capacity] = {}
    by_rate: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    tail_by_rate: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for doc, att, tail in scored:
        if not whole_run(doc):
            continue
        key = (doc["dataset"], doc["label"])
        groups.setdefault(key, Capacity(doc["label"], doc["dataset"]))
        by_rate[key][float(doc["rate"])].append(att)
        if tail is not None:
            tail_by_rate[key][float(doc["rate"])].append(tail)
    for key, cap in groups.items():
        cap.attainment = {r: by_rate[key][r] for r in sorted(by_rate[key])}
        cap.tail_attainment = {r: tail_by_rate[key][r] for r in cap.attainment if tail_by_rate[key][r]}
        for rate in cap.attainment:
            if cap.meets(rate, target):
                cap.sustained = rate
            else:
                cap.first_miss = rate
                break
    return sorted(groups.values(), key=lambda c: (c.dataset, c.label))


def baseline_for(caps: list[Capacity], dataset: str, prefix: str = "chunked") -> Capacity | None:
    """The strongest configuration of the dataset whose label starts with ``prefix``."""
    rivals = [c for c in caps if c.dataset == dataset and c.label.startswith(prefix)]
    return max(rivals, key=lambda c: c.sustained or 0.0, default=None)


def markdown(caps: list[Capacity], target: float = DEFAULT_TARGET) -> str:
    lines = [f"## Sustained rate (mean SLO attainment >= {target:.0%} at that rate and below, "
             "over whole runs and over their last third of arrivals)", "",
             "| dataset | label | sustained (req/s) | first miss (req/s) | vs best chunked | "
             "attainment per rate (mean [min-max] over runs) | last third's attainment per rate |",
             "|---|---|---|---|---|---|---|"]
    for c in caps:
        base = baseline_for(caps, c.dataset)
        ratio = "-"
        if base is not None and base.sustained and c.sustained and base is not c:
            ratio = f"{c.sustained / base.sustained:.2f}x {base.label}"
        per_rate = "; ".join(
            f"{r:g}: {mean(v):.1%}" + (f" [{min(v):.0%}-{max(v):.0%}] n={len(v)}" if len(v) > 1 else "")
            for r, v in c.attainment.items())
        tail = "; ".join(f"{r:g}: {mean(v):.1%}" for r, v in c.tail_attainment.items()) or "-"
        lines.append(f"| {c.dataset} | {c.label} | {'-' if c.sustained is None else f'{c.sustained:g}'} | "
                     f"{'-' if c.first_miss is None else f'{c.first_miss:g}'} | {ratio} | {per_rate} | {tail} |")
    return "\n".join(lines) + "\n"
