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

from dataclasses import dataclass, field
from statistics import mean

DEFAULT_TARGET = 0.9


@dataclass(frozen=True)
class RunScore:
    attainment: float  # fraction of the run's requests that met the SLO
    tail: float | None  # the same over its last third of arrivals, where scored
    drain_cut: bool = False  # interrupted after sending everything: a lower bound


@dataclass
class Capacity:
    label: str
    dataset: str
    # rate -> its runs, whole ones first, then those whose drain was cut
    runs: dict[float, list[RunScore]] = field(default_factory=dict)
    sustained: float | None = None  # None: not even the lowest measured rate meets the target
    first_miss: float | None = None  # None: no measured rate misses it

    @property
    def attainment(self) -> dict[float, list[float]]:
        """rate -> attainment of each run (fractions)."""
        return {r: [run.attainment for run in runs] for r, runs in self.runs.items()}

    @property
    def tail_attainment(self) -> dict[float, list[float]]:
        """rate -> attainment over each run's last third of arrivals, where scored."""
        tails = {r: [run.tail for run in runs if run.tail is not None] for r, runs in self.runs.items()}
        return {r: t for r, t in tails.items() if t}

    @property
    def lower_bounds(self) -> dict[float, int]:
        """rate -> how many of its runs had their drain cut."""
        cut = {r: sum(run.drain_cut for run in runs) for r, runs in self.runs.items()}
        return {r: n for r, n in cut.items() if n}

    def mean_attainment(self, rate: float) -> float:
        return mean(run.attainment for run in self.runs[rate])

    def meets(self, rate: float, target: float) -> bool:
        runs = self.runs[rate]
        whole = [run for run in runs if not run.drain_cut]
        # a lower bound that passes, passes; one that fails leaves the rate to its whole runs
        return _meets(runs, target) or (len(whole) < len(runs) and bool(whole) and _meets(whole, target))


def _meets(runs: list[RunScore], target: float) -> bool:
    tails = [run.tail for run in runs if run.tail is not None]
    return mean(run.attainment for run in runs) >= target and (not tails or mean(tails) >= target)


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
    # whole runs first, then those whose drain was cut (the report lists them in that order)
    ordered = [r for r in scored if whole_run(r[0])] + [r for r in scored if drain_cut(r[0])]
    for doc, att, tail in ordered:
        cap = groups.setdefault((doc["dataset"], doc["label"]), Capacity(doc["label"], doc["dataset"]))
        cap.runs.setdefault(float(doc["rate"]), []).append(RunScore(att, tail, not whole_run(doc)))
    for cap in groups.values():
        cap.runs = dict(sorted(cap.runs.items()))
        for rate in cap.runs:
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
        cut = c.lower_bounds
        per_rate = "; ".join(
            f"{r:g}: {mean(v):.1%}" + (f" [{min(v):.0%}-{max(v):.0%}] n={len(v)}" if len(v) > 1 else "")
            + (f" ({cut[r]} of them cut in their drain: a lower bound)" if cut.get(r) else "")
            for r, v in c.attainment.items())
        tail = "; ".join(f"{r:g}: {mean(v):.1%}" for r, v in c.tail_attainment.items()) or "-"
        lines.append(f"| {c.dataset} | {c.label} | {'-' if c.sustained is None else f'{c.sustained:g}'} | "
                     f"{'-' if c.first_miss is None else f'{c.first_miss:g}'} | {ratio} | {per_rate} | {tail} |")
    return "\n".join(lines) + "\n"
