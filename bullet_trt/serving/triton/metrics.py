"""Custom Prometheus metrics on Triton's metrics port (the Python backend's MetricFamily API).

    bullet_time_to_first_token_seconds     histogram  request arrival -> first generated token
    bullet_time_per_output_token_seconds   histogram  per request: (last - first token) / (n - 1)
    bullet_requests_waiting                gauge      queued in the engine, not yet scheduled
    bullet_requests_running                gauge      holding KV blocks in the engine
    bullet_kv_blocks_used / _free          gauge      the paged KV pool (free: the fewest of any rank's)
    bullet_kv_blocks_free_by_rank          gauge      by rank: each tensor-parallel rank's pool (rank 0 alone without TP)
    bullet_generation_tokens_total         counter    tokens generated since start
    bullet_preemptions_total               counter    sequences preempted for KV space
    bullet_requests_finished_total         counter    by reason: stop, length, abort, error, rejected
    bullet_requests_refused_total          counter    refused at once because the engine's queue was full
    bullet_engine_ready                    gauge      1 while the engine process serves, 0 after it died
    bullet_prefill_sms / _decode_sms       gauge      SMs of the last prefill / decode iteration (spatial modes)
    bullet_tpot_plan_fraction              gauge      bullet: decode's step beside a prefill, planned as this share of the TPOT SLO
    bullet_perf_model_correction           gauge      by phase (prefill, decode), spatial modes: measured step time over the
                                                      calibration's prediction, as the online correction holds it (far from 1:
                                                      the calibration no longer describes the steps run)
    bullet_kv_blocks_cached                gauge      kv.prefix_caching: blocks kept for later prompts (free blocks too)
    bullet_prefix_cache_hit_tokens_total   counter    kv.prefix_caching: prompt tokens found cached
    bullet_prefix_cache_prompt_tokens_total counter   kv.prefix_caching: prompt tokens looked up

Every series carries the labels model and version. Without Triton (unit tests, the offline
API) `Metrics(None)` accepts the same calls and records nothing but its own counters.

Every call into a Python-backend metric goes through one lock. The backend (tritonserver
2.51, python_backend r24.10) is not safe to call on one metric from two threads:
`increment` and `observe` release the GIL, then rewrite the metric's shared-memory record,
freeing the one a concurrent call has just handed to the server. The server then reads freed
shared memory and dies (SIGSEGV or std::bad_alloc in Metric::LoadFromSharedMemory). The reader
thread failing every open request after an engine death and execute() refusing new arrivals
both count `bullet_requests_finished_total{reason="error"}` at once, which is how an engine
death under load took the server down. Metric calls also never raise: a request's final
response is sent after its metrics are counted, and must not depend on them.
"""
from __future__ import annotations

import logging
import threading

from bullet_trt.engine.request import EngineStats

log = logging.getLogger("bullet_trt.serving.triton")

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")

NAMES = (
    "bullet_time_to_first_token_seconds", "bullet_time_per_output_token_seconds",
    "bullet_requests_waiting", "bullet_requests_running", "bullet_kv_blocks_used",
    "bullet_kv_blocks_free", "bullet_generation_tokens_total", "bullet_preemptions_total",
    "bullet_requests_finished_total", "bullet_engine_ready", "bullet_prefill_sms", "bullet_decode_sms",
    "bullet_requests_refused_total", "bullet_kv_blocks_free_by_rank", "bullet_tpot_plan_fraction",
    "bullet_kv_blocks_cached", "bullet_prefix_cache_hit_tokens_total", "bullet_prefix_cache_prompt_tokens_total",
    "bullet_perf_model_correction",
)


class _Null:
    def set(self, value):
        pass

    def increment(self, value):
        pass

    def observe(self, value):
        pass


class Metrics:
    def __init__(self, pb_utils=None, labels: dict[str, str] | None = None):
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        self._families = []
        self._metrics = []
        self._last: dict[str, float] = {}
        self._counted = {"tokens": 0, "preemptions": 0, "hits": 0, "looked_up": 0}  # the engine's totals so far
        self.finished = {r: 0 for r in FINISH_REASONS}
        self.refused = 0
        labels = dict(labels or {})
        fam = getattr(pb_utils, "MetricFamily", None) if pb_utils is not None else None

        def make(name, description, kind, extra_labels=None, buckets=None):
            if fam is None:
                return _Null()
            family = self._family(fam, name, description, kind)
            kwargs = {"labels": {**labels, **(extra_labels or {})}}
            if buckets is not None:
                kwargs["buckets"] = buckets
            metric = family.Metric(**kwargs)
            self._metrics.append(metric)
            return metric

        H = getattr(fam, "HISTOGRAM", None)
        G = getattr(fam, "GAUGE", None)
        C = getattr(fam, "COUNTER", None)
        self.ttft = make(NAMES[0], "Time from request arrival to its first generated token, seconds", H,
                         buckets=TTFT_BUCKETS)
        self.tpot = make(NAMES[1], "Mean time between output tokens of a finished request, seconds", H,
                         buckets=TPOT_BUCKETS)
        self.waiting = make(NAMES[2], "Requests queued in the engine, not yet scheduled", G)
        self.running = make(NAMES[3], "Requests the engine is running (holding KV blocks)", G)
        self.kv_used = make(NAMES[4], "KV-cache blocks in use", G)
        self.kv_free = make(NAMES[5], "KV-cache blocks free", G)
        self.tokens = make(NAMES[6], "Tokens generated since start", C)
        self.preemptions = make(NAMES[7], "Sequences preempted to free KV blocks", C)
        self.finished_by = {r: make(NAMES[8], "Requests finished, by reason", C, {"reason": r})
                            for r in FINISH_REASONS}
        self.ready = make(NAMES[9], "1 while the engine serves requests, 0 after it stopped", G)
        self.prefill_sms = make(NAMES[10], "SMs of the last prefill iteration (bullet and static modes)", G)
        self.decode_sms = make(NAMES[11], "SMs of the last decode iteration (bullet and static modes)", G)
        self.refused_total = make(NAMES[12], "Requests refused at once (UNAVAILABLE) because the engine's "
                                  "queue held serve.max_queue requests or serve.max_queue_tokens prompt tokens", C)
        self.tpot_plan = make(NAMES[14], "bullet: decode's step beside a prefill is planned for this fraction of "
                              "the TPOT SLO (serve.tpot_plan_fraction, moved by serve.tpot_plan_auto); 0 in other modes", G)
        self.kv_cached = make(NAMES[15], "KV-cache blocks kept for later prompts that start the same way "
                              "(kv.prefix_caching; counted as free: any allocation may take them back)", G)
        self.prefix_hits = make(NAMES[16], "Prompt tokens whose KV blocks were found cached (kv.prefix_caching)", C)
        self.prefix_looked_up = make(NAMES[17], "Prompt tokens looked up in the prefix cache (kv.prefix_caching)", C)
        self.perf_correction = {phase: make(NAMES[18], "Spatial modes: the performance model's online correction, "
                                            "measured step time over the calibration's prediction (0 in other modes)",
                                            G, {"phase": phase}) for phase in ("prefill", "decode")}
        # one per rank, made when the first stats say how many ranks there are
        self._rank_free = lambda rank: make(NAMES[13], "KV-cache blocks free in this tensor-parallel rank's pool",
                                            G, {"rank": str(rank)})
        self.kv_free_by_rank: list = []

    def _family(self, fam, name, description, kind):
        for known_name, family in self._families:
            if known_name == name:
                return family
        family = fam(name=name, description=description, kind=kind)
        self._families.append((name, family))
        return family

    # -- updates (called from engine and frontend threads) ----------------------------------
    def _call(self, metric, op: str, value: float) -> None:
        """One backend metric call; the caller holds self._lock."""
        if self._closed:
            return
        try:
            getattr(metric, op)(value)
        except Exception as e:
            if not self._warned:
                self._warned = True
                log.warning("bullet: custom metric %s failed (%s); further failures are not logged", op, e)

    def _set(self, key: str, metric, value: float) -> None:
        if self._last.get(key) != value:
            self._last[key] = value
            self._call(metric, "set", value)

    def update_stats(self, s: EngineStats) -> None:
        with self._lock:
            self._set("waiting", self.waiting, s.num_waiting)
            self._set("running", self.running, s.num_running)
            self._set("kv_used", self.kv_used, s.kv_blocks_total - s.kv_blocks_free)
            self._set("kv_free", self.kv_free, s.kv_blocks_free)
            for rank, free in enumerate(s.kv_blocks_free_by_rank):
                if rank == len(self.kv_free_by_rank):
                    if self._closed:
                        break  # a metric made now would outlive the families close() dropped
                    self.kv_free_by_rank.append(self._rank_free(rank))
                self._set(f"kv_free_rank{rank}", self.kv_free_by_rank[rank], free)
            self._set("prefill_sms", self.prefill_sms, getattr(s, "prefill_sms", 0))
            self._set("decode_sms", self.decode_sms, getattr(s, "decode_sms", 0))
            self._set("tpot_plan", self.tpot_plan, getattr(s, "tpot_plan", 0.0))
            for phase, metric in self.perf_correction.items():
                self._set(f"correction_{phase}", metric, round(getattr(s, f"perf_correction_{phase}", 0.0), 4))
            self._count("tokens", self.tokens, s.tokens_generated)
            self._count("preemptions", self.preemptions, s.num_preemptions)
            self._set("kv_cached", self.kv_cached, s.kv_blocks_cached)
            self._count("hits", self.prefix_hits, s.prefix_cache_hit_tokens)
            self._count("looked_up", self.prefix_looked_up, s.prefix_cache_prompt_tokens)

    def _count(self, key: str, metric, total: int) -> None:
        """A counter brought up to the engine's running total."""
        if total > self._counted[key]:
            self._call(metric, "increment", total - self._counted[key])
            self._counted[key] = total

    def set_ready(self, ready: bool) -> None:
        with self._lock:
            self._set("ready", self.ready, 1.0 if ready else 0.0)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._call(self.ttft, "observe", max(seconds, 0.0))

    def observe_tpot(self, seconds: float) -> None:
        with self._lock:
            self._call(self.tpot, "observe", max(seconds, 0.0))

    def request_finished(self, reason: str | None) -> None:
        reason = reason if reason in self.finished_by else "error"
        with self._lock:
            self.finished[reason] += 1
            self._call(self.finished_by[reason], "increment", 1)

    def request_refused(self) -> None:
        with self._lock:
            self.refused += 1
            self._call(self.refused_total, "increment", 1)

    def close(self) -> None:
        with self._lock:
            # A thread still finishing requests must not reach a metric the backend has deleted.
            self._closed = True
            # Metrics must go before their families (the backend checks the order).
            self._metrics.clear()
            self._families.clear()
