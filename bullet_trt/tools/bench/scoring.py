"""SLO scoring of a benchmark run: the default SLOs, and a stored run's attainment and
goodput under other SLOs (from its per-request values, so one set of runs can be judged
against several SLOs without measuring again)."""
from __future__ import annotations

from bullet_trt.tools.bench.metrics import slo_attainment

DEFAULT_TTFT_SLO_MS = 1000.0
DEFAULT_TPOT_SLO_MS = 50.0


def slos_ms(ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms: the given ones, the defaults for those not given."""
    return (DEFAULT_TTFT_SLO_MS if ttft_slo_ms is None else ttft_slo_ms,
            DEFAULT_TPOT_SLO_MS if tpot_slo_ms is None else tpot_slo_ms)


def rescore(doc: dict, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> dict:
    """The run's SLO attainment and goodput under other SLOs (from its per-request values)."""
    s = dict(doc["summary"])
    ttft_ms = ttft_slo_ms if ttft_slo_ms is not None else doc["slo"]["ttft_ms"]
    tpot_ms = tpot_slo_ms if tpot_slo_ms is not None else doc["slo"]["tpot_ms"]
    if (ttft_ms, tpot_ms) != (doc["slo"]["ttft_ms"], doc["slo"]["tpot_ms"]):
        reqs = doc.get("requests") or []
        ok = [bool(r.get("finished")) and r.get("error") is None for r in reqs]
        att = slo_attainment([r.get("ttft_s") for r in reqs], [r.get("tpot_s") for r in reqs],
                             ttft_ms / 1e3, tpot_ms / 1e3, ok)
        s["slo_attainment"] = att
        s["slo_met"] = round(att * len(reqs))
        s["goodput"] = s["slo_met"] / s["duration_s"] if s.get("duration_s") else 0.0
    s["ttft_slo_s"], s["tpot_slo_s"] = ttft_ms / 1e3, tpot_ms / 1e3
    return s
