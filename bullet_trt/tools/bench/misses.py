"""Which requests of a serving run missed its SLOs, and why, by output length.

A request's TPOT is the mean of its gaps between tokens, so a request of few tokens averages
few decode steps and one long step (a step planned near the TPOT SLO beside a prefill, or a
step that ran past its plan) decides it; a long request averages hundreds. Whether a run's
misses are TTFT's (the queue, prefill's share of the SMs) or TPOT's, and in which requests,
tells which of the policy's plans binds at that rate:

    bullet-trt bench misses RUN.json[.xz] ... [--edges 2,10,20,40,100]

prints, per run and per bucket of output tokens (edges: each bucket's lowest count, the last
open above), the requests, those that failed or did not finish, those whose first token came
after the TTFT SLO, those that met TTFT but averaged over the TPOT SLO, the attainment, the
bucket's TPOT median and p99, and the median of each request's longest gap between tokens.
Runs measured with `bench serve --token-times` also give the median of the first gap (first
token to second: in bullet's disaggregated decode, the wait for a decode step to take the new
row in, then that step) against the median of the later gaps.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from bullet_trt.tools.bench.metrics import RequestRecord, percentiles
from bullet_trt.tools.bench.results import load_result

DEFAULT_EDGES = (1, 10, 20, 40, 100)


@dataclass(frozen=True)
class BucketMisses:
    low: int  # output tokens, inclusive
    high: int | None  # exclusive; None: open above
    requests: int
    unfinished: int  # failed, or still running when the run ended
    ttft_missed: int
    tpot_missed: int  # first token in time, mean gap over the TPOT SLO
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    longest_gap_p50_ms: float | None
    first_gap_p50_ms: float | None = None  # only with the run's token times
    later_gap_p50_ms: float | None = None

    @property
    def attainment(self) -> float:
        missed = self.unfinished + self.ttft_missed + self.tpot_missed
        return 1.0 - missed / self.requests if self.requests else 0.0

    @property
    def label(self) -> str:
        return f"{self.low}+" if self.high is None else f"{self.low}-{self.high - 1}"


def misses_by_output_length(doc: dict, edges: tuple[int, ...] = DEFAULT_EDGES,
                            slos_s: tuple[float, float] | None = None) -> list[BucketMisses]:
    """The run's requests in buckets of output tokens (a request's planned length where it did
    not finish), each with its misses by cause under the run's own SLOs, or `slos_s` (TTFT,
    TPOT in seconds) where given."""
    ttft_slo_s, tpot_slo_s = slos_s or (doc["slo"]["ttft_ms"] / 1e3, doc["slo"]["tpot_ms"] / 1e3)
    bounds = sorted(set(edges))
    buckets = []
    for i, low in enumerate(bounds):
        high = bounds[i + 1] if i + 1 < len(bounds) else None
        reqs = [r for r in doc.get("requests") or []
                if low <= _length(r) and (high is None or _length(r) < high)]
        done = [r for r in reqs if r.get("finished") and r.get("error") is None and r.get("ttft_s") is not None]
        in_time = [r for r in done if r["ttft_s"] <= ttft_slo_s]
        tpots = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
        gaps = [r["itl_max_s"] for r in done if r.get("itl_max_s") is not None]
        itls = [RequestRecord.from_json(r).itls for r in done if r.get("chunk_times")]
        buckets.append(BucketMisses(
            low=low, high=high, requests=len(reqs), unfinished=len(reqs) - len(done),
            ttft_missed=len(done) - len(in_time),
            tpot_missed=sum(1 for r in in_time if (r.get("tpot_s") or 0.0) > tpot_slo_s),
            tpot_p50_ms=_ms_at(tpots, 50), tpot_p99_ms=_ms_at(tpots, 99),
            longest_gap_p50_ms=_ms_at(gaps, 50),
            first_gap_p50_ms=_ms_at([g[0] for g in itls if g], 50),
            later_gap_p50_ms=_ms_at([x for g in itls for x in g[1:]], 50)))
    return buckets


def run_misses(doc: dict, ttft_slo_s: float, tpot_slo_s: float) -> BucketMisses:
    """The whole run's misses by cause under these SLOs (seconds)."""
    return misses_by_output_length(doc, (0,), (ttft_slo_s, tpot_slo_s))[0]


def miss_causes(doc: dict, ttft_slo_s: float, tpot_slo_s: float) -> str:
    """The run's misses by cause in a few words ("" without any): what binds at its rate."""
    whole = run_misses(doc, ttft_slo_s, tpot_slo_s)
    causes = [(whole.unfinished, "failed or unfinished"), (whole.ttft_missed, "on TTFT"),
              (whole.tpot_missed, "on TPOT only")]
    said = [f"{n} {why}" for n, why in causes if n]
    return f"missed: {', '.join(said)}" if said else ""


def _ms_at(values_s: list[float], p: int) -> float | None:
    """The p-th percentile in ms, as the run's summary computes its own."""
    value = percentiles(values_s, (p,))[f"p{p}"]
    return None if value is None else 1e3 * value


def _length(r: dict) -> int:
    return r.get("num_output_tokens") if r.get("finished") else (r.get("max_tokens") or 0)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_misses(doc: dict, buckets: list[BucketMisses]) -> str:
    head = (f"{doc.get('label', '?')} {doc.get('dataset', '?')} {doc.get('rate', '?')} req/s "
            f"seed {doc.get('seed', '?')} (TTFT <= {doc['slo']['ttft_ms']:g} ms, TPOT <= {doc['slo']['tpot_ms']:g} ms)")
    rows = ["| output tokens | requests | failed or unfinished | TTFT missed | TPOT missed | attainment "
            "| TPOT p50 / p99 (ms) | longest gap p50 (ms) | first / later gaps p50 (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for b in buckets:
        if b.requests:
            rows.append(f"| {b.label} | {b.requests} | {b.unfinished} | {b.ttft_missed} | {b.tpot_missed} | "
                        f"{100 * b.attainment:.1f}% | {_ms(b.tpot_p50_ms)} / {_ms(b.tpot_p99_ms)} | "
                        f"{_ms(b.longest_gap_p50_ms)} | {_ms(b.first_gap_p50_ms)} / {_ms(b.later_gap_p50_ms)} |")
    return "\n".join([head, "", *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench misses", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="result JSONs of bench serve (.json, .json.gz, .json.xz)")
    ap.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                    help="lowest output-token count of each bucket, comma-separated "
                         f"(default {','.join(map(str, DEFAULT_EDGES))})")
    args = ap.parse_args(argv)
    try:
        edges = tuple(int(x) for x in args.edges.split(","))
    except ValueError:
        raise SystemExit(f"bullet-trt bench misses: --edges must be integers separated by commas, got {args.edges!r}")
    if not edges or min(edges) < 0:
        raise SystemExit(f"bullet-trt bench misses: --edges must be non-negative counts, got {args.edges!r}")
    for i, path in enumerate(args.runs):
        try:
            doc = load_result(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"bullet-trt bench misses: {path}: {e}")
        print(("\n" if i else "") + format_misses(doc, misses_by_output_length(doc, edges)))
    sys.stdout.flush()
    return 0
