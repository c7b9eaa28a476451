"""The serving benchmark's report: summary.md (one row per run, then each label's sustained
rate, bullet_trt/tools/bench/capacity.py) rebuilt from every result JSON in the directories and
files given, and the one-line summary printed after each run."""
from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Sequence

from bullet_trt.tools.bench import capacity
from bullet_trt.tools.bench.misses import miss_causes, run_misses
from bullet_trt.tools.bench.report_plots import plot_results
from bullet_trt.tools.bench.results import RESULT_KIND, load_results
from bullet_trt.tools.bench.scoring import rescore
from bullet_trt.tools.bench.steady_state import steady_state, tail_tokens_per_joule, tail_use_text


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def markdown_table(docs: list[dict], ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> str:
    docs = sorted(docs, key=lambda d: (d["dataset"], d["label"], d["rate"], d.get("seed", 0)))
    lines = ["# Serving benchmark", ""]
    slos = sorted({(ttft_slo_ms if ttft_slo_ms is not None else d["slo"]["ttft_ms"],
                    tpot_slo_ms if tpot_slo_ms is not None else d["slo"]["tpot_ms"]) for d in docs})
    lines.append("SLO: " + "; ".join(f"TTFT <= {a:g} ms and TPOT <= {b:g} ms" for a, b in slos)
                 + ". Latencies in ms (p50 / p90 / p99). Attainment counts failed requests as misses; "
                 "goodput = requests meeting the SLO per second. \"Last third\": the requests that arrived in "
                 "the last third of the arrival window, and the output tokens per second served then "
                 "against those asked for then (served below asked: the queue grew). Definitions: "
                 "docs/benchmarking.md.")
    lines.append("")
    head = ["label", "dataset", "rate (req/s)", "seed", "done", "req/s", "out tok/s", "TTFT p50/p90/p99",
            "TPOT p50/p90/p99", "ITL p50/p90/p99", "E2E p50", "SLO attain.", "missed: failed / TTFT / TPOT only",
            "goodput (req/s)",
            "last third: attain.", "last third: served / asked out tok/s", "last third: out tok/J",
            "SM clock / power / busy p50"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    scored, per_joule = [], {}
    for d in docs:
        s = rescore(d, ttft_slo_ms, tpot_slo_ms)
        tail = steady_state(d, s["ttft_slo_s"], s["tpot_slo_s"])
        scored.append((d, s["slo_attainment"], tail and tail.tail_attainment))
        per_joule[id(d)] = tail_tokens_per_joule(d, tail)

        def trio(key):
            v = s[key]
            return f"{_ms(v.get('p50'))} / {_ms(v.get('p90'))} / {_ms(v.get('p99'))}"

        row = [d["label"], d["dataset"], f"{d['rate']:g}", str(d.get("seed", 0)), f"{s['completed']}/{s['num_requests']}",
               f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}", trio("ttft_s"),
               trio("tpot_s"), trio("itl_s"), _ms(s["e2e_s"].get("p50")), f"{s['slo_attainment'] * 100:.1f}%",
               _missed_cell(d, s),
               # a run stopped early counted what it finished over a shortened span (report_plots.per_rate)
               "- (stopped)" if d.get("stopped_early") else f"{s['goodput']:.2f}",
               "-" if tail is None else f"{tail.tail_attainment * 100:.1f}%",
               "-" if tail is None else f"{tail.served_tok_s:.0f} / {tail.offered_tok_s:.0f}",
               "-" if per_joule[id(d)] is None else f"{per_joule[id(d)]:.1f}", _telemetry_cell(d)]
        lines.append("| " + " | ".join(row) + " |")
    caps = capacity.capacities(scored)
    lines += ["", capacity.markdown(caps)]
    lines += _energy_at_capacity(docs, caps, per_joule)
    lines += _engine_notes_section(docs)
    notes = [(d["label"], d["dataset"], d["rate"], n) for d in docs for n in
             ([f"stopped early: {d['stopped_early']}"] if d.get("stopped_early") else []) + list(d.get("notes") or [])]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {label} / {dset} / {rate:g} req/s: {n}" for label, dset, rate, n in notes]
    return "\n".join(lines) + "\n"


def _engine_notes_section(docs: list[dict]) -> list[str]:
    """What each label's started servers said about themselves (bench serve --start-server):
    the performance model they took and what they sized, which neither label nor overrides name."""
    said: dict[str, list[str]] = {}
    for d in docs:
        for note in d.get("engine_notes") or []:
            if note not in said.setdefault(d["label"], []):
                said[d["label"]].append(note)
    if not said:
        return []
    return ["", "Servers, in their own words at start:", ""] + [
        f"- {label}: " + " / ".join(notes) for label, notes in sorted(said.items())]


def rebuild_report(sources: Path | Sequence[Path], ttft_slo_ms: float | None = None,
                   tpot_slo_ms: float | None = None, plots: bool = True,
                   report_dir: Path | None = None) -> tuple[Path, list[Path]]:
    """summary.md (and the plots) from every result JSON in ``sources`` (directories or result
    files), written to ``report_dir``; without it, into the one directory given."""
    sources = [Path(sources)] if isinstance(sources, (str, Path)) else [Path(s) for s in sources]
    try:
        docs = load_results(*sources)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not docs:
        raise SystemExit(f"no benchmark results (*.json, *.json.gz or *.json.xz of kind {RESULT_KIND}) in "
                         + ", ".join(map(str, sources)))
    if report_dir is None:
        if len(sources) != 1 or not sources[0].is_dir():
            raise SystemExit("--compare of several sources, or of a file, needs --report-dir "
                             "(where to write summary.md and the plots)")
        report_dir = sources[0]
    report = Path(report_dir)
    report.mkdir(parents=True, exist_ok=True)
    md = report / "summary.md"
    md.write_text(markdown_table(docs, ttft_slo_ms, tpot_slo_ms))
    pngs = plot_results(docs, report, ttft_slo_ms, tpot_slo_ms) if plots else []
    return md, pngs


def format_row(doc: dict) -> str:
    s = doc["summary"]
    seed = f" seed {doc['seed']}" if doc.get("seed") else ""
    return (f"{doc['label']} {doc['dataset']} {doc['rate']:g} req/s{seed}: {s['completed']}/{s['num_requests']} done, "
            f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s, "
            + _responses_text(s) +
            f"TTFT p50 {_ms(s['ttft_s']['p50'])} ms p99 {_ms(s['ttft_s']['p99'])} ms, "
            f"TPOT p50 {_ms(s['tpot_s']['p50'])} ms p99 {_ms(s['tpot_s']['p99'])} ms, "
            f"SLO attainment {s['slo_attainment'] * 100:.1f}%{_missed_text(doc)}, goodput {s['goodput']:.2f} req/s"
            + _steady_state_text(doc) + _telemetry_text(doc))


def _missed_cell(doc: dict, s: dict) -> str:
    """A run's misses by cause under the SLOs it is scored against (which one binds there)."""
    if not doc.get("requests"):
        return "-"
    whole = run_misses(doc, s["ttft_slo_s"], s["tpot_slo_s"])
    return f"{whole.unfinished} / {whole.ttft_missed} / {whole.tpot_missed}"


def _missed_text(doc: dict) -> str:
    s = doc["summary"]
    said = miss_causes(doc, s["ttft_slo_s"], s["tpot_slo_s"]) if doc.get("requests") else ""
    return f" ({said})" if said else ""


def _responses_text(s: dict) -> str:
    """How many responses carried those tokens (runs written before 2026-11-26 lack it)."""
    if s.get("tokens_per_response") is None:
        return ""
    return f"{s['responses_per_s']:.0f} responses/s ({s['tokens_per_response']:.2f} tokens each), "


def _steady_state_text(doc: dict) -> str:
    s = doc["summary"]
    tail = steady_state(doc, s["ttft_slo_s"], s["tpot_slo_s"]) if doc.get("requests") else None
    if tail is None:
        return ""
    return (f"; last third of arrivals: attainment {tail.tail_attainment * 100:.1f}%, "
            f"{tail.served_tok_s:.0f} out tok/s served of {tail.offered_tok_s:.0f} asked" + tail_use_text(doc, tail))


def _energy_at_capacity(docs: list[dict], caps: list[capacity.Capacity], per_joule: dict[int, float | None]) -> list[str]:
    """Each label's output tokens per joule and median power at its first miss, where its runs
    served what they could: two modes alike per joule serve in the ratio of the power they draw,
    and a mode at the GPU's power cap has nowhere further to go (docs/benchmarks.md, "Tokens per
    joule")."""
    rows = []
    for c in caps:
        if c.first_miss is None:
            continue
        runs = [d for d in docs if (d["dataset"], d["label"], float(d["rate"])) == (c.dataset, c.label, c.first_miss)]
        joules = [per_joule[id(d)] for d in runs if per_joule[id(d)] is not None]
        watts = [t["power_w"]["p50"] for t in map(_telemetry, runs) if t]
        if joules and watts:
            rows.append(f"| {c.dataset} | {c.label} | {c.first_miss:g} | {mean(joules):.1f} | {mean(watts):.0f} W |")
    if not rows:
        return []
    return ["", "At capacity (each label's first miss, mean over its runs there): output tokens per joule over the "
            "last third, and the GPU's median power while requests arrived.", "",
            "| dataset | label | first miss (req/s) | out tok/J | power p50 |", "|---|---|---|---|---|"] + rows


def _telemetry(doc: dict) -> dict | None:
    """The GPU's sampled summary while requests arrived, if it has both clock and power."""
    t = (doc.get("gpu_telemetry") or {}).get("summary") or {}
    return t if t.get("sm_clock_mhz") and t.get("power_w") else None


def _telemetry_cell(doc: dict) -> str:
    """The GPU's clock, power and busy share while requests arrived: a power-capped GPU runs its
    SMs slower, which moves a mode's edge between hosts and between modes (docs/benchmarks.md)."""
    t = _telemetry(doc)
    if t is None:
        return "-"
    busy = _busy_p50(t)
    return (f"{t['sm_clock_mhz']['p50']:.0f} MHz / {t['power_w']['p50']:.0f} W"
            + ("" if busy is None else f" / {busy:.0f}%"))


def _busy_p50(t: dict) -> float | None:
    """NVML's utilization: the share of time some kernel ran. A mode whose host cannot launch
    steps as fast as the GPU runs them shows it low while requests queue (chunked's collapses
    on the H200, docs/benchmarks.md), where a GPU-bound one stays near 100%."""
    return (t.get("gpu_sm_util_pct") or {}).get("p50")


def _telemetry_text(doc: dict) -> str:
    t = _telemetry(doc)
    if t is None:
        return ""
    capped = t.get("power_capped_fraction")
    capped_text = f", power-capped {capped * 100:.0f}% of samples" if capped is not None else ""
    busy = _busy_p50(t)
    busy_text = f", busy p50 {busy:.0f}%" if busy is not None else ""
    return (f"; while arriving: SM clock p50 {t['sm_clock_mhz']['p50']:.0f} MHz, "
            f"power p50 {t['power_w']['p50']:.0f} W" + capped_text + busy_text)
