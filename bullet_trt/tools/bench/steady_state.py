"""Whether a run's server kept up with its arrivals, read from the run's last stretch.

A run offered more than the server can carry still meets its SLOs for a while: the queue
starts empty and needs time to grow past the TTFT budget. Its whole-run attainment therefore
depends on how long the arrivals lasted and on when the seed's bursts tipped it over, not on
the server alone: on one H100 a rate scored 96% over 60 s of arrivals and 37-50% over 120 s
with three other seeds, 100% in its first 40 s and 0% in its last (docs/benchmarks.md). The
figures here tell such a run apart from one in steady state:

- tail attainment: the SLO attainment of the requests that arrived in the last third of the
  arrival window. In steady state it matches the whole run's; under overload it falls.
- served and offered output tokens per second over that stretch: offered counts the output
  tokens the requests arriving then asked for, served the tokens the server delivered then
  (each request's tokens spread evenly between its first token and its end, since a result
  JSON keeps the latencies but not every token's time). Served below offered means the queue
  grew.

    bullet-trt bench steady RUN.json[.gz] ... [--windows 6]

prints each run's attainment per window of its arrivals (sixths: 20 s of a 120 s run), over
its first half and whole, its last third's figures, and the TTFT and TPOT medians per window
(a TPOT that still climbs in the last windows: the decode batch had not settled).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

from bullet_trt.tools.bench.energy import tokens_per_joule
from bullet_trt.tools.bench.metrics import slo_attainment

TAIL_FRACTION = 1 / 3


@dataclass(frozen=True)
class SteadyState:
    tail_attainment: float  # fraction of the last third's arrivals that met the SLO
    served_tok_s: float
    offered_tok_s: float
    window_s: tuple[float, float]  # the last third, in seconds since the run's start


def _attainment(reqs: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> float:
    return slo_attainment([r.get("ttft_s") for r in reqs], [r.get("tpot_s") for r in reqs], ttft_slo_s,
                          tpot_slo_s, [bool(r.get("finished")) and r.get("error") is None for r in reqs])


def _tokens_delivered_between(r: dict, start: float, end: float) -> float:
    if not r.get("finished") or r.get("ttft_s") is None or r.get("sent_s") is None:
        return 0.0
    first, last = r["sent_s"] + r["ttft_s"], r["sent_s"] + (r.get("e2e_s") or r["ttft_s"])
    n = r.get("num_output_tokens") or 0
    delivered = 1.0 if start <= first < end and n else 0.0
    lo, hi = max(start, first), min(end, last)
    if n > 1 and last > first and hi > lo:
        delivered += (n - 1) * (hi - lo) / (last - first)
    return delivered


def steady_state(doc: dict, ttft_slo_s: float, tpot_slo_s: float) -> SteadyState | None:
    """The run's last third, or None for a run too short to have one (under 3 requests)."""
    reqs = doc.get("requests") or []
    if len(reqs) < 3:
        return None
    window_end = max(r.get("scheduled_s") or 0.0 for r in reqs)
    window_start = window_end * (1 - TAIL_FRACTION)
    tail = [r for r in reqs if (r.get("scheduled_s") or 0.0) >= window_start]
    span = window_end - window_start
    offered = sum(r.get("max_tokens") or r.get("num_output_tokens") or 0 for r in tail)
    served = sum(_tokens_delivered_between(r, window_start, window_end) for r in reqs)
    return SteadyState(
        tail_attainment=_attainment(tail, ttft_slo_s, tpot_slo_s),
        served_tok_s=served / span if span > 0 else 0.0,
        offered_tok_s=offered / span if span > 0 else 0.0,
        window_s=(window_start, window_end))


def streaming_rows(doc: dict, window_s: tuple[float, float]) -> tuple[float, float] | None:
    """The number of requests streaming at once (between their first token and their end:
    the server's decoding rows, as the client saw them) over ``window_s``, weighted by time:
    (p50, p90), or None where no request streamed then. A server whose decode batch is capped
    (decode.max_num_seqs) shows these pinned just under the cap once its queue grows. Requests
    that never ended (a run cut short, a collapse) have no end time and are not counted."""
    start, end = window_s
    events = []
    for r in doc.get("requests") or []:
        if r.get("sent_s") is None or r.get("ttft_s") is None or r.get("e2e_s") is None:
            continue
        events += [(r["sent_s"] + r["ttft_s"], 1), (r["sent_s"] + r["e2e_s"], -1)]
    events.sort()
    level, at, time_at_level = 0, start, {}
    for t, step in events:
        if t > start:
            span = min(t, end) - at
            if span > 0:
                time_at_level[level] = time_at_level.get(level, 0.0) + span
            at = max(at, min(t, end))
        level += step
    if end > at:
        time_at_level[level] = time_at_level.get(level, 0.0) + end - at
    total = sum(time_at_level.values())
    if not any(n > 0 and spent > 0 for n, spent in time_at_level.items()):
        return None

    def quantile(q: float) -> float:
        seen = 0.0
        for n in sorted(time_at_level):
            seen += time_at_level[n]
            if seen >= q * total:
                return float(n)
        return float(max(time_at_level))
    return quantile(0.5), quantile(0.9)


def tail_tokens_per_joule(doc: dict, tail: SteadyState | None) -> float | None:
    """Output tokens per joule over the last third (bullet_trt/tools/bench/energy.py), where the
    run has GPU telemetry over it."""
    return None if tail is None else tokens_per_joule(doc, tail.served_tok_s, tail.window_s)


def tail_use_text(doc: dict, tail: SteadyState) -> str:
    """", N / M streaming at once (p50 / p90), X out tokens per joule" for the last third, each
    part where the run has it: how many decode rows the server ran, and what it made of the power."""
    rows = streaming_rows(doc, tail.window_s)
    per_joule = tail_tokens_per_joule(doc, tail)
    return (("" if rows is None else f", {rows[0]:.0f} / {rows[1]:.0f} streaming at once (p50 / p90)")
            + ("" if per_joule is None else f", {per_joule:.1f} out tokens per joule"))


def _arrival_parts(doc: dict, windows: int) -> list[list[dict]]:
    """The run's requests by the one of `windows` equal parts of the arrival window they were
    scheduled in."""
    reqs = doc.get("requests") or []
    end = max((r.get("scheduled_s") or 0.0 for r in reqs), default=0.0)
    parts: list[list[dict]] = [[] for _ in range(windows)]
    for r in reqs:
        at = r.get("scheduled_s") or 0.0
        parts[min(windows - 1, int(at / end * windows)) if end > 0 else 0].append(r)
    return parts


def attainment_by_window(doc: dict, ttft_slo_s: float, tpot_slo_s: float, windows: int) -> list[float | None]:
    """SLO attainment of the requests scheduled in each of `windows` equal parts of the arrival
    window (None for a part no request arrived in)."""
    return [_attainment(part, ttft_slo_s, tpot_slo_s) if part else None for part in _arrival_parts(doc, windows)]


def median_by_window(doc: dict, key: str, windows: int) -> list[float | None]:
    """The median of `key` (ttft_s, tpot_s) over the finished requests scheduled in each part of
    the arrival window (None where none has it). A TPOT median still rising in the last parts
    says the decode batch had not settled when the arrivals stopped: the rate is at or past
    what the server carries, however well the run scored."""
    out: list[float | None] = []
    for part in _arrival_parts(doc, windows):
        values = [r[key] for r in part if r.get("finished") and r.get(key) is not None]
        out.append(statistics.median(values) if values else None)
    return out


def main(argv: list[str] | None = None) -> int:
    from bullet_trt.tools.bench.results import load_result

    ap = argparse.ArgumentParser(prog="bullet-trt bench steady", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="result JSON files of bench serve (.json, .json.gz or .json.xz)")
    ap.add_argument("--windows", type=int, default=6, help="parts of the arrival window (default 6)")
    args = ap.parse_args(argv)
    if args.windows < 2:
        raise SystemExit(f"--windows must be >= 2, got {args.windows}")
    for path in args.runs:
        doc = load_result(path)
        s = doc["summary"]
        slo = (s["ttft_slo_s"], s["tpot_slo_s"])
        if not doc.get("requests"):
            print(f"{path}: no per-request records (requests_not_kept)", file=sys.stderr)
            continue
        parts = attainment_by_window(doc, *slo, args.windows)
        halves = attainment_by_window(doc, *slo, 2)
        tail = steady_state(doc, *slo)
        shown = " ".join("-" if a is None else f"{a * 100:.0f}" for a in parts)

        def medians_ms(key: str) -> str:
            return " ".join("-" if m is None else f"{m * 1e3:.0f}" for m in median_by_window(doc, key, args.windows))
        print(f"{doc['label']} {doc['dataset']} {doc['rate']:g} req/s seed {doc.get('seed', 0)}: "
              f"attainment in {args.windows} parts of the arrivals {shown}; first half {halves[0] * 100:.1f}%, "
              f"whole {s['slo_attainment'] * 100:.1f}%; last third {tail.tail_attainment * 100:.1f}%, "
              f"{tail.served_tok_s:.0f} of {tail.offered_tok_s:.0f} out tok/s served{tail_use_text(doc, tail)}; "
              f"TTFT p50 per part {medians_ms('ttft_s')} ms; TPOT p50 per part {medians_ms('tpot_s')} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
