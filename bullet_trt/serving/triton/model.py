"""The TritonPythonModel behind model_repository/bullet (decoupled transaction policy).

Flow of one request::

    execute()  (stub main thread)     parse + validate + tokenize (frontend.py), then
                                      engine.add_request(NewRequest, callback)
    engine reader thread              callback per RequestOutput: text per token (TextStream:
                                      incremental detokenization, stop strings), kept as the
                                      request's pending text
    response threads (delivery.py)    one response per request with all its pending text
                                      (stream=true) or one at the end (stream=false), FINAL
                                      flag last; a request always on the same thread
    cancellation thread               polls request.is_cancelled() and aborts in the engine

Every request ends with exactly one response (or flag) carrying
TRITONSERVER_RESPONSE_COMPLETE_FINAL: its last text, an error naming the input and the
limit it broke, "cancelled", a refusal because the engine's queue is full (UNAVAILABLE:
retry later or elsewhere), "server is shutting down" (UNAVAILABLE), or the engine's failure.
An error's message starts with ``[request id: <id>] ``, the id the client gave the request
(no prefix without one): Triton's gRPC stream drops the id of an error response, and a
client with many requests on one stream reads it from there (request_errors.py). If the
engine process dies, in-flight requests get an error, `bullet_engine_ready` drops to 0 and,
when the server runs with ``--model-control-mode=explicit`` (as `bullet-trt serve` starts
it), the model unloads itself so that Triton reports it not ready.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bullet_trt.config import load_engine_config
from bullet_trt.engine.request import NewRequest, RequestOutput
from bullet_trt.engine.validation import RequestError, RequestLimits
from bullet_trt.serving.triton.delivery import Delivery
from bullet_trt.serving.triton.frontend import Frontend, FrontendLimits, ParsedRequest
from bullet_trt.serving.triton.metrics import Metrics
from bullet_trt.serving.triton.request_errors import with_request_id
from bullet_trt.serving.engine_process import SHUTTING_DOWN, AsyncEngine, EngineClient, EngineUnavailable
from bullet_trt.serving.text_stream import TextStream
from bullet_trt.engine.gc_freeze import freeze_startup_objects

log = logging.getLogger("bullet_trt.serving.triton")

ENGINE_DIR_ENV = "BULLET_ENGINE_DIR"
OVERRIDES_ENV = "BULLET_OVERRIDES"  # JSON object of dotted config keys, set by `bullet-trt serve --set`

# Model parameters (config.pbtxt) that are not engine-config overrides.
MODEL_PARAMS = {
    "engine_dir": "engines/default",
    "default_max_tokens": "64",
    "max_tokens_limit": "0",  # 0 = max_model_len - 1
    "exclude_input_in_output": "true",
    "cancel_poll_ms": "20",
    # request.is_cancelled() is a round trip to Triton's side, as a send is: each poll checks
    # at most this many requests a second, in turn, so that hundreds of streams do not
    # crowd out their own responses
    "cancel_checks_per_s": "500",
    "response_threads": "4",  # threads sending responses (delivery.py)
    "engine_threads": "0",  # torch threads in the engine process; 0 = torch's default
    "engine_start_timeout_s": "600",
    "unload_on_engine_failure": "true",
}


def _truthy(value: str) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def model_parameters(model_config: dict) -> tuple[dict[str, str], dict[str, str]]:
    """Splits config.pbtxt parameters into model parameters and dotted engine overrides."""
    raw = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    params = dict(MODEL_PARAMS)
    overrides: dict[str, str] = {}
    for key, value in raw.items():
        if key in MODEL_PARAMS:
            params[key] = value
        elif "." in key:
            if value.strip() and not value.strip().startswith("${"):
                overrides[key] = value
        else:
            raise ValueError(f"unknown parameter {key!r} in config.pbtxt; known: "
                             f"{', '.join(MODEL_PARAMS)} and dotted engine keys such as serve.mode")
    env = os.environ.get(OVERRIDES_ENV, "").strip()
    if env:
        extra = json.loads(env)
        if not isinstance(extra, dict):
            raise ValueError(f"{OVERRIDES_ENV} must hold a JSON object of dotted keys, got {env!r}")
        overrides.update({str(k): str(v) for k, v in extra.items()})
    return params, overrides


def resolve_engine_dir(value: str, model_dir: Path | None) -> Path:
    """BULLET_ENGINE_DIR wins; a relative path is looked up from the project root."""
    value = os.environ.get(ENGINE_DIR_ENV) or value or MODEL_PARAMS["engine_dir"]
    path = Path(value).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        bases = []
        if model_dir is not None:
            bases.append(model_dir.resolve().parent.parent)  # <root>/model_repository/bullet
        bases.append(Path(__file__).resolve().parents[2])  # the checkout holding bullet_trt
        bases.append(Path.cwd())
        candidates = [b / path for b in bases]
    for c in candidates:
        if (c / "engine.yaml").is_file():
            return c
    raise FileNotFoundError(
        f"engine directory {value!r} not found (looked in {', '.join(str(c) for c in candidates)}): "
        f"build one with `python build_engines.py` or point {ENGINE_DIR_ENV} at one")


def client_request_id(request) -> str:
    """The id the client gave `request` ("" if none)."""
    try:
        return request.request_id() or ""
    except Exception:
        return ""


def next_turn(active: list, checked: int, limit: int) -> tuple[list, int]:
    """The next `limit` of `active`, going on from `checked` (the count so far) and round from
    the end to the start, so that every request is checked in turn however many there are;
    returns them and the new count."""
    if not active:
        return [], checked
    start = checked % len(active)
    turn = (active[start:] + active[:start])[:limit]
    return turn, start + len(turn)


@dataclass
class _Active:
    """One request in flight."""

    rid: str
    request: object
    sender: object
    parsed: ParsedRequest
    text_stream: TextStream
    arrival: float
    client_id: str = ""  # the client's id for it (rid is ours, for the engine)
    lock: threading.Lock = field(default_factory=threading.Lock)
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    pending_tokens: int = 0
    pending_logprobs: list[float] = field(default_factory=list)
    all_logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    pieces: list[str] = field(default_factory=list)  # stream=false: the text so far
    pending_text: str = ""  # stream=true: text not yet sent
    shard: int = 0  # the response thread that sends this request's responses
    scheduled: bool = False  # queued on its response thread, which will send all that is pending
    ending: tuple[str, str | None] | None = None  # (reason, error) once the request ended
    sent_any: bool = False
    cancelled: bool = False
    done: bool = False  # ended: its final response is decided (it may not have left yet)


class TritonPythonModel:
    """Triton loads this through model_repository/bullet/1/model.py."""

    # -- life cycle ---------------------------------------------------------------------------
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        self.pb = pb_utils
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("model_repository/bullet must use the decoupled transaction policy "
                             "(model_transaction_policy { decoupled: true })")
        self.model_name = args.get("model_name", "bullet")
        self.batched = int(self.model_config.get("max_batch_size", 0)) > 0
        params, overrides = model_parameters(self.model_config)
        model_dir = Path(args["model_repository"]) if args.get("model_repository") else None
        engine_dir = resolve_engine_dir(params["engine_dir"], model_dir)
        self.cfg = load_engine_config(engine_dir, overrides)

        from bullet_trt.model.tokenizer import Tokenizer
        self.tokenizer = Tokenizer(self.cfg.tokenizer_path)
        limits = RequestLimits(self.cfg.max_model_len, vocab_size=self.tokenizer.vocab_size,
                               max_tokens_cap=int(params["max_tokens_limit"]) or None)
        self.frontend = Frontend(self.tokenizer, FrontendLimits(
            limits, default_max_tokens=min(int(params["default_max_tokens"]), limits.max_tokens_limit),
            exclude_input_in_output=_truthy(params["exclude_input_in_output"])))
        self.unload_on_failure = _truthy(params["unload_on_engine_failure"])
        self.metrics = Metrics(pb_utils, {"model": self.model_name, "version": str(args.get("model_version", ""))})

        self.engine: AsyncEngine = EngineClient(
            self.cfg, factory="bullet_trt.serving.modes:create_served_engine", on_stats=self.metrics.update_stats,
            on_death=self._on_engine_death, num_threads=int(params["engine_threads"]),
            start_timeout=float(params["engine_start_timeout_s"]), server_pid=os.getppid()).start()
        self.metrics.set_ready(True)
        log.info("bullet: engine %s ready (pid %s, max_model_len %d, mode %s)", engine_dir,
                 getattr(self.engine, "pid", "?"), self.cfg.max_model_len, self.cfg.serve.mode)

        self._ids = itertools.count()
        self._delivery = Delivery(int(params["response_threads"]), self._deliver)
        self._active: dict[str, _Active] = {}
        self._active_lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = max(int(params["cancel_poll_ms"]), 1) / 1000.0
        self._checks_per_poll = max(1, round(float(params["cancel_checks_per_s"]) * self._poll_s))
        self._watcher = threading.Thread(target=self._watch_cancellation, name="bullet-cancel", daemon=True)
        self._watcher.start()
        # The stub's reader thread detokenizes every token and its response threads send them;
        # a full collection over what start-up built held them for 45-80 ms at a time under load.
        freeze_startup_objects()

    def finalize(self):
        self._stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # answers every in-flight request with an error
        if getattr(self, "_delivery", None) is not None:
            self._delivery.close()  # those answers leave before the model goes
        if getattr(self, "_watcher", None) is not None:
            self._watcher.join(timeout=2)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()

    # -- requests -----------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            try:
                self._start(request)
            except Exception as e:  # never let one request take the others down
                log.exception("bullet: unexpected error while starting a request")
                try:
                    sender, client_id = request.get_response_sender(), client_request_id(request)
                except Exception:
                    log.exception("bullet: a request Triton handed over cannot be answered")
                    continue
                self._send_error_final(sender, client_id, f"internal error: {e}", "INTERNAL")
        return None

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        arrival = time.monotonic()
        client_id = client_request_id(request)
        try:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parsed = self.frontend.parse(inputs)
        except RequestError as e:
            self.metrics.request_finished("rejected")
            self._send_error_final(sender, client_id, str(e), "INVALID_ARG")
            return
        n = next(self._ids)
        rid = f"r{n}"
        stream = TextStream(self.tokenizer, parsed.params.stop, parsed.params.min_tokens)
        state = _Active(rid, request, sender, parsed, stream, arrival, client_id=client_id, shard=n)
        with self._active_lock:
            self._active[rid] = state
        try:
            self.engine.add_request(NewRequest(rid, parsed.prompt_token_ids, parsed.params),
                                    lambda out, st=state: self._on_output(st, out))
        except (EngineUnavailable, ValueError) as e:
            with self._active_lock:
                self._active.pop(rid, None)
            code = "UNAVAILABLE" if isinstance(e, EngineUnavailable) else "INVALID_ARG"
            msg = f"engine is not ready: {e}" if isinstance(e, EngineUnavailable) else str(e)
            with state.lock:
                # The engine's failure path may have ended it between registering and failing.
                if state.done:
                    return
                state.done = True
                self._send_error_final(sender, client_id, msg, code)
            self.metrics.request_finished("error" if isinstance(e, EngineUnavailable) else "rejected")

    # -- engine outputs (reader thread) ---------------------------------------------------------
    def _on_output(self, st: _Active, out: RequestOutput) -> None:
        if st.done:  # ended here at a stop string; this is the engine's answer to the abort
            return
        now = time.monotonic()
        if out.new_token_ids:
            if st.first_token is None:
                st.first_token = now
                self.metrics.observe_ttft(now - st.arrival)
            st.last_token = now
        # A stop string ends the output at the token that completed it, even when the reader
        # merged several steps into this output: only the tokens up to it count.
        before = st.text_stream.num_tokens
        piece = st.text_stream.extend(out.new_token_ids)
        used = st.text_stream.num_tokens - before
        with st.lock:  # a response thread takes the pending counts
            st.num_output_tokens += used
            st.pending_tokens += used
            if out.new_logprobs:
                logprobs = out.new_logprobs[:used]
                st.pending_logprobs.extend(logprobs)
                st.all_logprobs.extend(logprobs)
                st.cum_logprob += float(sum(logprobs))
        if st.text_stream.stopped:
            if not out.finished:
                self.engine.abort(st.rid)  # its KV blocks return at the engine's next step
            self._finish(st, "stop", None, piece)
            return
        if out.finished:
            piece += st.text_stream.finish()
            reason = "stop" if st.text_stream.stopped else out.finish_reason or ("error" if out.error else "stop")
            self._finish(st, reason, out.error, piece)
            return
        if not piece:
            return
        if st.parsed.stream:
            with st.lock:
                if st.done or st.cancelled:
                    return
                st.pending_text += piece
                self._schedule(st)
        else:
            st.pieces.append(piece)

    def _finish(self, st: _Active, reason: str, error: str | None, piece: str) -> None:
        with self._active_lock:
            self._active.pop(st.rid, None)
        if st.first_token is not None and st.num_output_tokens > 1:
            self.metrics.observe_tpot((st.last_token - st.first_token) / (st.num_output_tokens - 1))
        if reason == "overloaded":
            self.metrics.request_refused()
        else:
            self.metrics.request_finished("error" if reason == "shutdown" else reason)
        with st.lock:
            if st.done:
                return
            st.done = True
            st.ending = (reason, error)
            if st.parsed.stream:
                st.pending_text += piece
            else:
                st.pieces.append(piece)
            self._schedule(st)

    def _schedule(self, st: _Active) -> None:
        """Queues `st` on its response thread unless it waits there already (which then sends
        all that is pending). Called with st.lock held."""
        if not st.scheduled:
            st.scheduled = True
            self._delivery.put(st.shard, st)

    def _deliver(self, st: _Active) -> None:
        """On st's response thread: one response with all of its pending text, or its final
        one. The send waits for Triton's side outside st.lock, so the reader adds tokens
        meanwhile; they leave with the next response."""
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with st.lock:
            st.scheduled = False
            text, st.pending_text = st.pending_text, ""
            ending, st.ending = st.ending, None
            if ending is None:
                if st.done or st.cancelled or not text:  # done: its final response has left already
                    return
                response = self._response(st, text)
            else:
                reason, error = ending
                if not st.parsed.stream:
                    text = "".join(st.pieces)
                    if not st.parsed.exclude_input_in_output:
                        text = st.parsed.text + text
                response = self._ending_response(st, reason, error, text)
        if ending is None:
            if not self._send(st, response, 0):
                with st.lock:
                    st.cancelled = True
                self.engine.abort(st.rid)
        elif isinstance(response, tuple):  # an error: (message, code)
            self._send_error_final(st.sender, st.client_id, *response)
        else:
            self._send(st, response, final)

    def _ending_response(self, st: _Active, reason: str, error: str | None, text: str):
        """The final response of a request that ended for `reason`: an error as (message,
        code), a response, or None (the flag alone). Called with st.lock held."""
        if reason == "rejected":  # the engine refused it at admission (names field and limit)
            return error or "request rejected", "INVALID_ARG"
        if reason in ("overloaded", "shutdown"):  # not served now; a retry may be
            return error or "server unavailable", "UNAVAILABLE"
        if error or reason == "error":
            return error or "request failed", "INTERNAL" if self.engine.is_ready() else "UNAVAILABLE"
        if reason == "abort":
            return "request cancelled", "CANCELLED"
        if not st.parsed.stream:
            return self._response(st, text, whole=True)
        if text or not st.sent_any or st.parsed.return_num_output_tokens or st.parsed.return_log_probs:
            return self._response(st, text)
        return None

    def _response(self, st: _Active, text: str, whole: bool = False):
        pb = self.pb
        p = st.parsed

        def tensor(name, values, dtype):
            a = np.asarray(values, dtype=dtype).reshape(-1)
            return pb.Tensor(name, a.reshape((1, -1)) if self.batched else a)

        outs = [tensor("text_output", [text.encode("utf-8")], np.object_)]
        if p.return_num_input_tokens:
            outs.append(tensor("num_input_tokens", [len(p.prompt_token_ids)], np.int32))
        if p.return_num_output_tokens:
            outs.append(tensor("num_output_tokens", [st.num_output_tokens if whole else st.pending_tokens],
                               np.int32))
        if p.return_log_probs:
            outs.append(tensor("cum_log_probs", [st.cum_logprob], np.float32))
            outs.append(tensor("output_log_probs", st.all_logprobs if whole else st.pending_logprobs,
                               np.float32))
        st.pending_tokens = 0
        st.pending_logprobs = []
        return pb.InferenceResponse(output_tensors=outs)

    def _send(self, st: _Active, response, flags: int) -> bool:
        try:
            if response is None:
                st.sender.send(flags=flags)
            else:
                st.sender.send(response, flags=flags)
            st.sent_any = True
            return True
        except Exception as e:  # the client went away
            log.info("bullet: request %s: response not delivered (%s)", st.rid, e)
            return False

    def _error(self, message: str, code: str):
        err_cls = self.pb.TritonError
        code_value = getattr(err_cls, code, None)
        if code_value is not None:
            try:
                return err_cls(message, code_value)
            except TypeError:
                pass
        return err_cls(message)

    def _send_error_final(self, sender, client_id: str, message: str, code: str) -> None:
        """Ends a request with an error. Its message names the client's request id, since
        Triton's gRPC stream drops an error response's id (request_errors.py)."""
        message = with_request_id(message, client_id)
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            sender.send(self.pb.InferenceResponse(output_tensors=[], error=self._error(message, code)), flags=final)
        except Exception as e:
            log.warning("bullet: error response not delivered (%s): %s", e, message)
            # The flag alone still ends the request: Triton holds a request whose sender never
            # sent it, and a model with one cannot finish unloading.
            try:
                sender.send(flags=final)
            except Exception as again:
                log.warning("bullet: request %s not ended either (%s)", client_id, again)

    # -- cancellation and health ----------------------------------------------------------------
    def _watch_cancellation(self) -> None:
        checked = 0  # requests checked so far: each poll goes on from where the last stopped
        while not self._stop.wait(self._poll_s):
            with self._active_lock:
                active = list(self._active.values())
            turn, checked = next_turn(active, checked, self._checks_per_poll)
            for st in turn:
                with st.lock:
                    if st.done or st.cancelled:
                        continue
                    try:
                        cancelled = st.request.is_cancelled()
                    except Exception:
                        cancelled = False
                    if cancelled:
                        st.cancelled = True
                if st.cancelled:
                    self.engine.abort(st.rid)

    def _on_engine_death(self, reason: str) -> None:
        (log.info if reason == SHUTTING_DOWN else log.error)("bullet: %s; the model is no longer ready", reason)
        self.metrics.set_ready(False)
        # a shutdown unloads every model itself; asking for it again only logs a false error
        if self.unload_on_failure and reason != SHUTTING_DOWN:
            threading.Thread(target=self._unload_self, name="bullet-unload", daemon=True).start()

    def _unload_self(self, settle_s: float = 5.0, grace_s: float = 1.0) -> None:
        # tritonserver 2.51 aborts (its gRPC frontend's proto_buffer_writer.h:65 assertion) when
        # a model unloads while the error finals of the requests it had in flight are still
        # being written to their streams. A send returns before the frontend has written the
        # response, so the unload waits for the finals to be handed over, then a grace period
        # (docs/serving.md, Health: measured crash rates with and without it).
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            with self._active_lock:
                if not self._active:
                    break
            time.sleep(0.01)
        self._delivery.wait_idle(max(0.0, deadline - time.monotonic()))
        time.sleep(grace_s)
        try:
            self.pb.unload_model(self.model_name)
            log.error("bullet: unloaded model %s after the engine failure", self.model_name)
        except Exception as e:
            log.error("bullet: could not unload model %s (%s); it keeps answering every request with "
                      "an error. Start tritonserver with --model-control-mode=explicit to have it "
                      "reported not ready.", self.model_name, e)
