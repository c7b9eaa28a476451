"""Open-loop load generator: gRPC streaming against the Triton model, per-response timestamps.

Each request leaves at its scheduled arrival time whatever happened to the earlier ones (open
loop: a slow server builds a queue, it does not slow the client down). All requests share
one bidirectional gRPC stream per client (``--streams`` spreads them over several), with
the TensorRT-LLM tensor names::

    text_input [1,1] BYTES, max_tokens, min_tokens [1,1] INT32 (min = max: exactly the
    workload's output length is generated), stream=true, exclude_input_in_output=true,
    return_num_input_tokens / return_num_output_tokens=true, temperature (0: greedy), top_p and
    top_k when given

The callback stamps every response with ``time.perf_counter()`` and its token count: the
response's ``num_output_tokens`` (this server reports the tokens of that response when
streaming), or 1 per non-empty ``text_output`` when the server does not return it. A
request ends with the response flagged ``triton_final_response`` or with an error. The
stream hands an error over without its request's id; the error's message names it instead
(``[request id: <id>] ``, bullet_trt/serving/triton/request_errors.py), and an error that
names none is only counted, in the run's notes.

The run is bounded: after the last request has been sent, the generator waits at most
``drain_timeout_s`` for the stragglers (and never longer than ``timeout_s`` in all), then
cancels the stream; unfinished requests are recorded as errors. Ctrl-C stops it the same
way and keeps what was measured. With ``give_up_at_misses`` it also stops, the same way, once
that many requests are known to miss the TTFT SLO (``ttft_slo_s``) or have failed
(bullet_trt/tools/bench/decided.py says when a sweep asks for it).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from bullet_trt.serving.triton.request_errors import split_request_id
from bullet_trt.tools.bench.datasets import BenchRequest
from bullet_trt.tools.bench.metrics import RequestRecord


@dataclass
class LoadGenOptions:
    model: str = "bullet"
    temperature: float = 0.0
    top_p: float = 1.0  # sent only below 1
    top_k: int = 0  # sent only above 0
    fixed_output: bool = True  # send min_tokens = max_tokens
    seed: int | None = None
    streams: int = 1
    timeout_s: float = 3600.0  # the whole run
    drain_timeout_s: float = 600.0  # after the last send
    progress_interval_s: float = 1.0
    ttft_slo_s: float | None = None  # with give_up_at_misses: what a known miss is
    give_up_at_misses: int | None = None  # stop once this many requests are known misses


@dataclass
class Progress:
    elapsed_s: float
    total: int
    sent: int
    finished: int
    failed: int
    in_flight: int
    p50_ttft_s: float | None


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_wall: float  # time.time() at t = 0
    stopped_early: str | None = None  # why the run did not wait for every request
    notes: list[str] = field(default_factory=list)


def _np_type(dt: str):
    return {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32,
            "BOOL": np.bool_}[dt]


def build_inputs(req: BenchRequest, opts: LoadGenOptions):
    """tritonclient.grpc InferInputs ([1, 1] tensors) for one request."""
    import tritonclient.grpc as grpcclient

    fields: list[tuple[str, object, str]] = [
        ("text_input", req.prompt.encode("utf-8"), "BYTES"),
        ("max_tokens", req.output_tokens, "INT32"),
        ("stream", True, "BOOL"),
        ("exclude_input_in_output", True, "BOOL"),
        ("return_num_input_tokens", True, "BOOL"),
        ("return_num_output_tokens", True, "BOOL"),
        ("temperature", opts.temperature, "FP32"),
    ]
    if opts.top_p < 1.0:
        fields.append(("top_p", opts.top_p, "FP32"))
    if opts.top_k > 0:
        fields.append(("top_k", opts.top_k, "INT32"))
    if opts.fixed_output:
        fields.append(("min_tokens", req.output_tokens, "INT32"))
    if opts.seed is not None:
        fields.append(("seed", (opts.seed + req.index) % (1 << 63), "UINT64"))
    out = []
    for name, value, dt in fields:
        arr = np.array([[value]], dtype=_np_type(dt))
        inp = grpcclient.InferInput(name, [1, 1], dt)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


class LoadGenerator:
    """Sends a workload to ``url`` (gRPC host:port) and records what came back."""

    def __init__(self, url: str, options: LoadGenOptions | None = None,
                 on_progress: Callable[[Progress], None] | None = None):
        self.url = url
        self.opts = options or LoadGenOptions()
        self.on_progress = on_progress
        self._lock = threading.Lock()
        self._records: dict[str, RequestRecord] = {}
        self._done: set[str] = set()
        self._first: set[str] = set()
        self._missed: set[str] = set()  # ended without meeting the TTFT SLO, or got their first token too late
        self._sender_done = False
        self._ttfts: list[float] = []
        self._t0 = 0.0
        self._stop = threading.Event()
        self._all_done = threading.Event()
        self._unmatched_errors: list[str] = []
        self._clients: list = []
        self._broken: str | None = None
        self._closing = False

    # -- callbacks (gRPC stream threads) -----------------------------------------------------
    def _callback(self, result, error) -> None:
        now = time.perf_counter() - self._t0
        if error is not None:
            msg = error.message() if hasattr(error, "message") and callable(error.message) else str(error)
            rid, rest = split_request_id(msg or "")
            with self._lock:
                rec = self._records.get(rid) if rid else None
                if rec is None:
                    if self._closing:  # our own cancellation at the end of the run
                        return
                    self._unmatched_errors.append(msg)
                    if self._stream_broken():
                        self._abort_all(now, f"gRPC stream failed: {msg}")
                    return
                if rid not in self._done:
                    rec.error = rest or "error"  # without the id: reports count errors by message
                    rec.end_s = now
                    self._finish(rid)
            return
        resp = result.get_response()
        rid = resp.id
        params = resp.parameters
        final = "triton_final_response" in params and params["triton_final_response"].bool_param
        n_tok = None
        n_in = None
        text_pieces = 0
        try:
            if any(o.name == "num_output_tokens" for o in resp.outputs):
                n_tok = int(np.asarray(result.as_numpy("num_output_tokens")).reshape(-1)[0])
            if any(o.name == "num_input_tokens" for o in resp.outputs):
                n_in = int(np.asarray(result.as_numpy("num_input_tokens")).reshape(-1)[0])
            if n_tok is None and any(o.name == "text_output" for o in resp.outputs):
                text = result.as_numpy("text_output")
                text_pieces = sum(1 for x in np.asarray(text).reshape(-1) if len(x))
        except Exception as e:  # a malformed response: record it, keep going
            with self._lock:
                rec = self._records.get(rid)
                if rec is not None and rid not in self._done:
                    rec.error = f"bad response: {e}"
                    rec.end_s = now
                    self._finish(rid)
            return
        tokens = n_tok if n_tok is not None else text_pieces
        with self._lock:
            rec = self._records.get(rid)
            if rec is None or rid in self._done:
                return
            if resp.outputs:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(tokens)
                if tokens > 0 and rid not in self._first:
                    self._first.add(rid)
                    ttft = now - (rec.sent_s if rec.sent_s is not None else now)
                    self._ttfts.append(ttft)
                    if self.opts.ttft_slo_s is not None and ttft > self.opts.ttft_slo_s:
                        self._missed.add(rid)
            if n_in is not None:
                rec.num_input_tokens = n_in
            if final:
                rec.end_s = now
                rec.finished = True
                self._finish(rid)

    def _stream_broken(self) -> bool:
        """True when a stream can carry nothing more (tritonclient marks it inactive after a
        gRPC-level error: the server went away, the connection broke)."""
        return any(getattr(getattr(c, "_stream", None), "_active", True) is False for c in self._clients)

    def _abort_all(self, now: float, why: str) -> None:  # under the lock
        """Every request still running fails with ``why``; the run stops."""
        self._broken = why
        for rid, rec in self._records.items():
            if rid not in self._done and rec.sent_s is not None:
                rec.error = why
                rec.end_s = now
                self._done.add(rid)
        self._stop.set()
        self._all_done.set()

    def _finish(self, rid: str) -> None:  # under the lock
        self._done.add(rid)
        if not self._records[rid].finished or rid not in self._first:  # failed, or ended without a token
            self._missed.add(rid)
        if len(self._done) == len(self._records) and self._sender_done:
            self._all_done.set()

    # -- the run ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stops sending and ends the run (from another thread or a signal handler)."""
        self._stop.set()
        self._all_done.set()

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        import tritonclient.grpc as grpcclient

        opts = self.opts
        inputs = [build_inputs(r, opts) for r in requests]  # before the clock starts
        rids = [f"b{r.index}" for r in requests]
        self._records = {rid: RequestRecord(r.index, r.arrival_s, r.input_tokens, r.output_tokens)
                         for rid, r in zip(rids, requests)}
        self._done = set()
        self._first = set()
        self._missed = set()
        self._ttfts = []
        self._sender_done = False
        self._stop.clear()
        self._all_done.clear()
        clients = self._clients = []
        self._broken = None
        self._closing = False
        self._unmatched_errors = []
        try:
            for _ in range(max(1, opts.streams)):
                c = grpcclient.InferenceServerClient(self.url)
                c.start_stream(callback=self._callback)
                clients.append(c)
            started_wall = time.time()
            self._t0 = time.perf_counter()
            sender = threading.Thread(target=self._send_all, args=(clients, requests, rids, inputs),
                                      name="loadgen-sender", daemon=True)
            sender.start()
            stopped = self._wait(sender, requests)
        finally:
            self._stop.set()
            with self._lock:
                self._closing = True
            cancel = any(rid not in self._done for rid in self._records)
            for c in clients:
                try:
                    c.stop_stream(cancel_requests=cancel)
                except Exception:
                    pass
                try:
                    c.close()
                except Exception:
                    pass
        notes = []
        with self._lock:
            for rid, rec in self._records.items():
                if rid in self._done:
                    continue
                if rec.sent_s is None:
                    rec.error = f"not sent ({stopped or 'stopped'})"
                else:
                    rec.error = f"no final response ({stopped or 'stream closed'})"
                    rec.end_s = None
            if self._unmatched_errors:
                notes.append(f"{len(self._unmatched_errors)} stream errors without a request id, e.g. "
                             f"{self._unmatched_errors[0][:200]!r}")
        return RunResult([self._records[rid] for rid in rids], started_wall, stopped, notes)

    def _send_all(self, clients, requests, rids, inputs) -> None:
        opts = self.opts
        try:
            for i, (req, rid, inp) in enumerate(zip(requests, rids, inputs)):
                while not self._stop.is_set():
                    delay = req.arrival_s - (time.perf_counter() - self._t0)
                    if delay <= 0:
                        break
                    if delay > 0.002:
                        self._stop.wait(delay - 0.001)  # sleep, then spin the last millisecond
                if self._stop.is_set():
                    return
                rec = self._records[rid]
                with self._lock:
                    rec.sent_s = time.perf_counter() - self._t0
                try:
                    clients[i % len(clients)].async_stream_infer(
                        opts.model, inp, request_id=rid, enable_empty_final_response=True)
                except Exception as e:
                    with self._lock:
                        rec.error = f"send failed: {e}"
                        rec.end_s = time.perf_counter() - self._t0
                        self._finish(rid)
        finally:
            with self._lock:
                self._sender_done = True
                if len(self._done) == len(self._records):
                    self._all_done.set()

    def _progress(self, total: int) -> Progress:
        with self._lock:
            sent = sum(1 for r in self._records.values() if r.sent_s is not None)
            finished = sum(1 for rid in self._done if self._records[rid].finished)
            failed = len(self._done) - finished
            p50 = float(np.median(self._ttfts)) if self._ttfts else None
        return Progress(time.perf_counter() - self._t0, total, sent, finished, failed,
                        sent - finished - failed, p50)

    def _known_misses(self, now: float) -> int:
        """Requests that can no longer meet the TTFT SLO: those the callbacks marked (failed,
        ended without a token, first token later than it) and those still waiting past it."""
        slo = self.opts.ttft_slo_s
        with self._lock:
            waiting = sum(1 for rid, rec in self._records.items()
                          if rec.sent_s is not None and rid not in self._first and rid not in self._done
                          and now - rec.sent_s > slo)
            return len(self._missed) + waiting

    def _wait(self, sender: threading.Thread, requests: Sequence[BenchRequest]) -> str | None:
        opts = self.opts
        last_arrival = requests[-1].arrival_s if requests else 0.0
        deadline_total = opts.timeout_s
        try:
            while True:
                if self._all_done.wait(opts.progress_interval_s):
                    if self.on_progress:
                        self.on_progress(self._progress(len(requests)))
                    if self._broken:
                        return self._broken
                    return "stopped" if self._stop.is_set() and len(self._done) < len(self._records) else None
                elapsed = time.perf_counter() - self._t0
                if self.on_progress:
                    self.on_progress(self._progress(len(requests)))
                if elapsed > deadline_total:
                    return f"run exceeded timeout_s={opts.timeout_s:g}"
                if opts.give_up_at_misses is not None and opts.ttft_slo_s is not None:
                    misses = self._known_misses(elapsed)
                    if misses >= opts.give_up_at_misses:
                        self._stop.set()
                        return (f"decided: {misses} of {len(requests)} requests missed the SLO "
                                f"{elapsed:.0f} s into the run, so its rate cannot reach the target")
                if not sender.is_alive() and elapsed > last_arrival + opts.drain_timeout_s:
                    return f"still running {opts.drain_timeout_s:g} s after the last send (drain_timeout_s)"
        except KeyboardInterrupt:
            self._stop.set()
            return "interrupted"
