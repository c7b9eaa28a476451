"""The serving benchmark's plots, per dataset: SLO attainment and goodput against the
request rate (one line per label), and TTFT / TPOT CDFs per rate."""
from __future__ import annotations

from pathlib import Path

from bullet_trt.tools.bench.capacity import drain_cut, whole_run
from bullet_trt.tools.bench.metrics import cdf
from bullet_trt.tools.bench.results import slug
from bullet_trt.tools.bench.scoring import rescore


def per_rate(runs: list[dict], scored: list[dict], key: str, scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    """The rates and, per rate, each run's `key` (times `scale`). Goodput only from runs that
    ran to their end: one stopped when its rate was decided counted the requests it finished
    over its shortened span (a bullet run at 32 req/s stopped after 55 s showed 24 req/s,
    more than any complete run of either mode), while its attainment stands."""
    kept = [(d, s) for d, s in zip(runs, scored) if key != "goodput" or not d.get("stopped_early")]
    rates = sorted({d["rate"] for d, _ in kept})
    return rates, [[s[key] * scale for d, s in kept if d["rate"] == r] for r in rates]


def plot_results(docs: list[dict], out_dir: Path, ttft_slo_ms: float | None = None,
                 tpot_slo_ms: float | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written: list[Path] = []
    for dataset in sorted({d["dataset"] for d in docs}):
        group = [d for d in docs if d["dataset"] == dataset]
        labels = sorted({d["label"] for d in group})
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
        slo_text = ""
        for label in labels:
            # as the sustained rate does: a run interrupted before it sent every request did
            # not measure its window; one cut in its drain is a lower bound
            runs = [d for d in group if d["label"] == label and (whole_run(d) or drain_cut(d))]
            if not runs:
                continue
            scored = [rescore(d, ttft_slo_ms, tpot_slo_ms) for d in runs]
            for ax, (rates, values) in ((ax1, per_rate(runs, scored, "slo_attainment", 100.0)),
                                        (ax2, per_rate(runs, scored, "goodput"))):
                if not rates:
                    continue
                # repeated runs (seeds) of one rate: the mean, with the spread as error bars
                mid = [sum(v) / len(v) for v in values]
                spread = [[m - min(v) for m, v in zip(mid, values)], [max(v) - m for m, v in zip(mid, values)]]
                ax.errorbar(rates, mid, yerr=spread, marker="o", capsize=3, label=label)
            slo_text = f"TTFT <= {scored[0]['ttft_slo_s'] * 1e3:g} ms, TPOT <= {scored[0]['tpot_slo_s'] * 1e3:g} ms"
        ax1.set_xlabel("request rate (req/s)")
        ax1.set_ylabel("SLO attainment (%)")
        ax1.set_ylim(-3, 103)
        ax1.grid(alpha=0.3)
        ax1.set_title(f"{dataset}: SLO attainment ({slo_text})", fontsize=9)
        ax2.set_xlabel("request rate (req/s)")
        ax2.set_ylabel("goodput (req/s meeting the SLO)")
        ax2.grid(alpha=0.3)
        ax2.set_title(f"{dataset}: goodput", fontsize=9)
        # below both axes: labels that name their overrides are longer than one axis is wide
        handles, names = ax1.get_legend_handles_labels()
        fig.legend(handles, names, loc="outside lower center", fontsize=8)
        written.append(_save(fig, out_dir / f"slo_attainment_{slug(dataset)}.png"))

        for rate in sorted({d["rate"] for d in group}):
            runs = [d for d in group if d["rate"] == rate]
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
            for label in sorted({d["label"] for d in runs}):
                # one CDF per label over the requests of all its repeats at this rate
                reqs = [r for d in runs if d["label"] == label
                        for r in d.get("requests") or [] if r.get("finished") and not r.get("error")]
                for ax, key in ((ax1, "ttft_s"), (ax2, "tpot_s")):
                    x, y = cdf(r.get(key) for r in reqs)
                    if x.size:
                        ax.step(x * 1e3, y, where="post", label=label)
            s0 = rescore(runs[0], ttft_slo_ms, tpot_slo_ms)
            for ax, name, slo in ((ax1, "TTFT", s0["ttft_slo_s"]), (ax2, "TPOT", s0["tpot_slo_s"])):
                ax.axvline(slo * 1e3, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo * 1e3:g} ms")
                ax.set_xlabel(f"{name} (ms)")
                ax.set_ylabel("fraction of requests")
                ax.set_ylim(0, 1.02)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
                ax.set_title(f"{dataset} at {rate:g} req/s: {name} CDF", fontsize=9)
            written.append(_save(fig, out_dir / f"latency_cdf_{slug(dataset)}_rate{rate:g}.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
