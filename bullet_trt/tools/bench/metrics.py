"""Serving metrics from per-request timestamps.

Times are seconds on one monotonic clock (``time.perf_counter``) relative to the start of the
run. For each request the load generator records when it was sent and the time and token
count of every streamed response ("chunk"); a chunk usually carries one token.

Definitions (the ones docs/benchmarking.md gives):

- TTFT: first chunk that carries a token - send time.
- TPOT: (last token time - first token time) / (output tokens - 1); undefined for 1 token.
- ITL (inter-token latency): the gaps between consecutive token-bearing chunks of a request;
  a chunk of k tokens counts as one gap (so ITL is per chunk, as in vLLM's benchmark).
- E2E latency: final response - send time.
- Request throughput: completed requests / run duration; token throughputs likewise with the
  output (and input) tokens of completed requests. The duration runs from the first send to
  the last final response.
- SLO attainment: the fraction of ALL requests (failed ones count as misses) that finished
  with TTFT <= ttft_slo and TPOT <= tpot_slo (a 1-token request has no TPOT and meets that
  half). Goodput: the requests meeting the SLO per second of the run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request did (times in seconds from the start of the run)."""

    index: int
    scheduled_s: float  # when the workload said to send it
    input_tokens: int  # wanted prompt length
    max_tokens: int
    sent_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    num_input_tokens: int | None = None  # as the server reported it
    error: str | None = None
    finished: bool = False  # got its final response without an error

    @property
    def num_output_tokens(self) -> int:
        return int(sum(self.chunk_tokens))

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None

    def token_times(self) -> list[float]:
        """Token-bearing chunk times (one entry per chunk)."""
        return [t for t, k in zip(self.chunk_times, self.chunk_tokens) if k > 0]

    @property
    def ttft(self) -> float | None:
        times = self.token_times()
        if not times or self.sent_s is None:
            return None
        return times[0] - self.sent_s

    @property
    def tpot(self) -> float | None:
        times = self.token_times()
        n = self.num_output_tokens
        if len(times) < 1 or n < 2:
            return None
        return (times[-1] - times[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        times = self.token_times()
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e(self) -> float | None:
        if self.end_s is None or self.sent_s is None:
            return None
        return self.end_s - self.sent_s

    def meets_slo(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        if not self.ok or self.ttft is None:
            return False
        tpot = self.tpot
        return self.ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)

    def to_json(self, token_times: bool = False) -> dict:
        """Compact: derived latencies; the raw chunk times only when asked."""
        d = {"index": self.index, "scheduled_s": _r(self.scheduled_s), "sent_s": _r(self.sent_s),
             "end_s": _r(self.end_s), "input_tokens": self.input_tokens, "max_tokens": self.max_tokens,
             "num_input_tokens": self.num_input_tokens, "num_output_tokens": self.num_output_tokens,
             "num_chunks": sum(1 for k in self.chunk_tokens if k > 0),
             "ttft_s": _r(self.ttft), "tpot_s": _r(self.tpot), "e2e_s": _r(self.e2e),
             "finished": self.finished, "error": self.error}
        itl = self.itls
        d["itl_max_s"] = _r(max(itl)) if itl else None
        if token_times:
            d["chunk_times"] = [_r(t) for t in self.chunk_times]
            d["chunk_tokens"] = list(self.chunk_tokens)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        r = cls(d["index"], d.get("scheduled_s") or 0.0, d.get("input_tokens", 0), d.get("max_tokens", 0),
                d.get("sent_s"), list(d.get("chunk_times") or []), list(d.get("chunk_tokens") or []),
                d.get("end_s"), d.get("num_input_tokens"), d.get("error"), bool(d.get("finished")))
        return r


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict:
    """{"mean", "p50", "p90", "p99", "n"} with numpy's linear interpolation; None when empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict = {"n": int(a.size), "mean": float(a.mean()) if a.size else None}
    for p in ps:
        out[f"p{p:g}"] = float(np.percentile(a, p)) if a.size else None
    return out


@dataclass
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed req/s
    output_token_throughput: float  # tok/s
    input_token_throughput: float
    # streamed responses that carried tokens, a second, and the tokens each carried: a server
    # whose responses fall behind its tokens merges several into one
    responses_per_s: float
    tokens_per_response: float | None
    total_output_tokens: int
    total_input_tokens: int
    ttft_s: dict
    tpot_s: dict
    itl_s: dict
    e2e_s: dict
    ttft_slo_s: float
    tpot_slo_s: float
    slo_met: int
    slo_attainment: float  # fraction of all requests
    goodput: float  # req/s meeting the SLO
    send_lag_s: dict  # how late requests left against their schedule (client health)
    errors: dict  # message -> count (first 10 distinct)

    def to_json(self) -> dict:
        return asdict(self)


def run_duration(records: Sequence[RequestRecord]) -> float:
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sent or not ends:
        return 0.0
    return max(ends) - min(sent)


def summarize(records: Sequence[RequestRecord], ttft_slo_s: float, tpot_slo_s: float,
              duration_s: float | None = None) -> Summary:
    ok = [r for r in records if r.ok]
    dur = run_duration(records) if duration_s is None else duration_s
    met = sum(1 for r in records if r.meets_slo(ttft_slo_s, tpot_slo_s))
    out_tok = sum(r.num_output_tokens for r in ok)
    responses = sum(1 for r in ok for k in r.chunk_tokens if k > 0)
    in_tok = sum((r.num_input_tokens if r.num_input_tokens is not None else r.input_tokens) for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = r.error.strip().splitlines()[0][:200] if r.error.strip() else "error"
            if key in errors or len(errors) < 10:
                errors[key] = errors.get(key, 0) + 1
    per = lambda n: (n / dur) if dur > 0 else 0.0  # noqa: E731
    return Summary(
        num_requests=len(records), completed=len(ok), failed=len(records) - len(ok), duration_s=dur,
        request_throughput=per(len(ok)), output_token_throughput=per(out_tok), input_token_throughput=per(in_tok),
        responses_per_s=per(responses), tokens_per_response=(out_tok / responses) if responses else None,
        total_output_tokens=out_tok, total_input_tokens=in_tok,
        ttft_s=percentiles(r.ttft for r in ok), tpot_s=percentiles(r.tpot for r in ok),
        itl_s=percentiles(x for r in ok for x in r.itls), e2e_s=percentiles(r.e2e for r in ok),
        ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, slo_met=met,
        slo_attainment=(met / len(records)) if records else 0.0, goodput=per(met),
        send_lag_s=percentiles((r.sent_s - r.scheduled_s) for r in records if r.sent_s is not None),
        errors=errors)


def slo_attainment(ttfts: Sequence[float | None], tpots: Sequence[float | None], ttft_slo_s: float,
                   tpot_slo_s: float, ok: Sequence[bool] | None = None) -> float:
    """Attainment from per-request values (used to re-score stored runs with other SLOs)."""
    n = len(ttfts)
    if n == 0:
        return 0.0
    ok = ok if ok is not None else [True] * n
    met = sum(1 for a, b, good in zip(ttfts, tpots, ok)
              if good and a is not None and a <= ttft_slo_s and (b is None or b <= tpot_slo_s))
    return met / n


def cdf(values: Iterable[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their cumulative fractions (for plotting)."""
    a = np.sort(np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float))
    return a, (np.arange(1, a.size + 1) / a.size if a.size else a)
