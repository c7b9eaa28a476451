"""The engine behind a server: an `AsyncEngine` interface and `EngineClient`, which runs
`EngineCore` in a process of its own.

The server side (the Triton model) only ever talks to an `AsyncEngine`: it adds a request
with a callback, aborts by id, reads stats and asks whether the engine is ready. Whatever
engine serve.mode builds (bullet_trt/serving/modes.py) runs behind it unchanged.

Process layout of `EngineClient`::

    parent (Triton stub)                          engine process (spawned)
      add_request ──► inbox AddRequest              loop: drain inbox (block when idle)
      abort       ──► inbox AbortRequest                  core.step()
      shutdown    ──► inbox Shutdown                      outbox ◄── StepOutputs / StatsUpdate
      reader thread ◄── outbox, dispatches each RequestOutput to its request's callback

The messages are the typed ones of bullet_trt/protocol.py.

Messages are small (token ids, ids, counters); the weights and the KV pool never cross.
If the engine process dies, every request still in flight gets a final error output and
`is_ready()` turns false; nothing waits forever.
"""
from __future__ import annotations

import abc
import importlib
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from bullet_trt.engine.gc_freeze import freeze_startup_objects
from bullet_trt.engine.request import EngineStats, NewRequest, RequestOutput, coalesce
from bullet_trt.engine.stall_watch import StallWatch
from bullet_trt.protocol import (AbortRequest, AddRequest, EngineFailed, EngineInfo, EngineReady, EngineStopped,
                                 Shutdown, StatsUpdate, StepOutputs)
from bullet_trt.serving.admission import QueueBound

log = logging.getLogger("bullet_trt.engine_process")

OutputCallback = Callable[[RequestOutput], None]
StatsCallback = Callable[[EngineStats], None]

SHUTTING_DOWN = "server is shutting down"


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started yet, shutting down, or its process died)."""


class AsyncEngine(abc.ABC):
    """What a serving frontend needs from an engine, whatever runs underneath.

    Every request added is answered through its callback, from an engine thread: zero or
    more outputs with new tokens, then exactly one output with ``finished=True``:
    finish_reason "stop", "length", "abort", "rejected" (the engine refused the request at
    admission; ``error`` names the field and the limit), "overloaded" (refused at once because
    the engine's queue is full, bullet_trt/serving/admission.py; ``error`` names the bound),
    "shutdown" (the server is shutting down) or "error" (``error`` says why, e.g. the engine
    process died).
    """

    @abc.abstractmethod
    def add_request(self, request: NewRequest, callback: OutputCallback) -> None:
        """Queues a request; raises EngineUnavailable when the engine cannot take it."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stops a request at the next step; its final output has finish_reason "abort"."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The latest engine counters (queue depths, KV blocks, tokens generated)."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True while the engine accepts requests."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Ends every in-flight request with an error and stops the engine."""

    # optional hooks, shared by implementations
    @property
    def failure(self) -> str | None:
        """Why the engine stopped being ready, when it did so on its own."""
        return None


def python_executable() -> str:
    """The interpreter to spawn the engine with.

    Inside Triton's Python-backend stub ``sys.executable`` is whatever ``python3`` was first
    on PATH when the stub started, which may not be the interpreter whose packages the stub
    imported; `bullet-trt serve` exports BULLET_PYTHON with the right one.
    """
    exe = os.environ.get("BULLET_PYTHON")
    if exe and os.access(exe, os.X_OK):
        return exe
    if sys.executable and os.access(sys.executable, os.X_OK):
        return sys.executable
    found = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}") or shutil.which("python3")
    if not found:
        raise EngineUnavailable("cannot find a Python interpreter to run the engine process: set BULLET_PYTHON")
    return found


def _load_factory(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# -------------------------------------------------------------------------------------------
# engine process side
# -------------------------------------------------------------------------------------------

class _Lifeline:
    """Whether anyone is left to serve: the parent (the Python backend's stub) and, when the
    client named it, the server above the parent.

    tritonserver's death leaves the stub to exit by itself, but python_backend 24.10's stub
    can hang on the way out: its health thread waits for a lock that a pending
    request.is_cancelled() holds while it waits for the dead server's answer. The engine and
    its workers would then outlive the server, so the stub is ended here when its parent is no
    longer the server (an orphan is re-parented the moment its parent exits)."""

    def __init__(self, server_pid: int | None):
        self.parent = mp.parent_process()
        self.server_pid = server_pid

    def _parent_orphaned(self) -> bool:
        try:
            stat = Path(f"/proc/{self.parent.pid}/stat").read_text()
        except OSError:
            return False  # not Linux, or the parent is gone (is_alive says so)
        return int(stat.rsplit(")", 1)[1].split()[1]) != self.server_pid

    def holds(self) -> bool:
        if self.parent is None:
            return True
        if not self.parent.is_alive():
            return False
        if self.server_pid and self._parent_orphaned():
            log.error("the server (pid %d) is gone; ending its Python-backend stub (pid %d)",
                      self.server_pid, self.parent.pid)
            try:
                os.kill(self.parent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return False
        return True


def _engine_main(cfg, factory: str, engine_kwargs: dict, inbox, outbox, stats_interval: float,
                 num_threads: int, server_pid: int | None = None) -> None:
    """Runs in the spawned process: build the engine, then serve messages until told to stop."""
    lifeline = _Lifeline(server_pid)
    try:
        # A process group of our own: should this process die, the client kills the group,
        # so that worker processes the engine started do not outlive it.
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        if num_threads > 0:
            import torch
            torch.set_num_threads(num_threads)
        core = _load_factory(factory)(cfg, **engine_kwargs)
        freeze_startup_objects()
        info = EngineInfo(pid=os.getpid(), pgid=os.getpgid(0), max_model_len=cfg.max_model_len,
                          max_prompt_len=cfg.max_prompt_len,
                          eos_token_ids=list(getattr(core, "eos_token_ids", [])), stats=core.stats())
        outbox.put(EngineReady(info))
    except BaseException:  # report why start-up failed, then exit
        outbox.put(EngineFailed(traceback.format_exc()))
        return
    try:
        _engine_loop(core, inbox, outbox, stats_interval, lifeline, QueueBound.from_config(cfg))
    except BaseException:
        outbox.put(EngineFailed(traceback.format_exc()))
        raise
    finally:
        close = getattr(core, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass


class _StopSignal:
    """SIGTERM as a request to stop between two steps, so that every request held ends with an
    answer ("server is shutting down") and its blocks, and the workers stop with the engine.
    Installed once serving starts: during start-up SIGTERM still ends the process at once."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, _signum, _frame) -> None:
        self.requested = True


def _engine_loop(core, inbox, outbox, stats_interval: float, lifeline: _Lifeline, bound: QueueBound) -> None:
    watch = StallWatch.from_env("engine loop")
    try:
        _serve(core, inbox, outbox, stats_interval, lifeline, watch, bound, _StopSignal())
    finally:
        if watch:
            watch.close()


def _stop_serving(core, inbox, outbox) -> None:
    """Ends every request held, and those still in the inbox, with SHUTTING_DOWN."""
    outputs = core.fail_all(SHUTTING_DOWN)
    while True:
        try:
            msg = inbox.get_nowait()
        except (queue.Empty, EOFError, OSError):
            break
        if isinstance(msg, AddRequest):
            outputs.append(RequestOutput(msg.request.request_id, [], finished=True,
                                         num_prompt_tokens=len(msg.request.prompt_token_ids)))
    for out in outputs:
        out.finish_reason, out.error = "shutdown", SHUTTING_DOWN
    outbox.put(StepOutputs(outputs, core.stats()))
    outbox.put(EngineStopped(SHUTTING_DOWN))


def _serve(core, inbox, outbox, stats_interval: float, lifeline: _Lifeline, watch: StallWatch | None,
           bound: QueueBound, stop: _StopSignal) -> None:
    last_stats = None
    last_stats_time = 0.0
    last_parent_check = time.monotonic()
    while True:
        if stop.requested:
            _stop_serving(core, inbox, outbox)
            return
        busy = core.has_unfinished()
        # Idle: sleep on the queue (waking once a second to notice a dead parent).
        # Busy: only take what is already there, then step.
        try:
            msg = inbox.get(timeout=1.0) if not busy else inbox.get_nowait()
        except queue.Empty:
            msg = None
        if time.monotonic() - last_parent_check >= 1.0:
            last_parent_check = time.monotonic()
            if not lifeline.holds():  # nobody is left to read our outputs
                # Unread outputs fill the pipe; without this the queue's feeder thread would
                # block the interpreter's exit forever.
                outbox.cancel_join_thread()
                return
        if watch:
            watch.begin()
            t_intake = time.perf_counter()
        taken = 0
        rejected = []
        intake = bound.intake(core.stats()) if msg is not None else None
        while msg is not None:
            taken += 1
            match msg:
                case AddRequest(request=req):
                    n = len(req.prompt_token_ids)
                    why = intake.refusal(n)
                    if why is not None:
                        rejected.append(RequestOutput(req.request_id, [], finished=True, finish_reason="overloaded",
                                                      num_prompt_tokens=n, error=why))
                    else:
                        try:
                            core.add_request(req)
                            intake.admitted(n)
                        except Exception as e:  # ValueError names the field and the limit
                            rejected.append(RequestOutput(req.request_id, [], finished=True,
                                                          finish_reason="rejected", num_prompt_tokens=n,
                                                          error=str(e)))
                case AbortRequest(request_id=rid):
                    core.abort_request(rid)
                case Shutdown():
                    return
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                msg = None
        if rejected:  # answered now, not after the step about to run
            outbox.put(StepOutputs(rejected, core.stats()))
        outputs = []
        if watch:
            t_step = time.perf_counter()
        if core.has_unfinished():
            outputs = core.step()
        if watch:
            t_put = time.perf_counter()
        now = time.monotonic()
        stats = core.stats()
        if outputs:
            outbox.put(StepOutputs(outputs, stats))
            last_stats, last_stats_time = stats, now
        elif stats != last_stats and (now - last_stats_time >= stats_interval or not core.has_unfinished()):
            outbox.put(StatsUpdate(stats))
            last_stats, last_stats_time = stats, now
        if watch:
            end = time.perf_counter()
            watch.end(messages=taken, intake_ms=(t_step - t_intake) * 1e3, step_ms=(t_put - t_step) * 1e3,
                      put_ms=(end - t_put) * 1e3, outputs=len(outputs), running=stats.num_running,
                      waiting=stats.num_waiting)


# -------------------------------------------------------------------------------------------
# server side
# -------------------------------------------------------------------------------------------

class EngineClient(AsyncEngine):
    """Runs the engine built by ``factory(cfg, **engine_kwargs)`` in a spawned process
    (default: `create_engine`, the engine for cfg.serve.mode).

    factory: "module:callable" building the engine inside the child (tests swap in fakes).
    on_stats: called from the reader thread with every EngineStats the engine sends.
    on_death: called once, from the reader thread, when the engine process exits unasked.
    server_pid: the server this process serves (tritonserver, for the Triton model); the engine
    process ends when it is gone, even if this process cannot.
    """

    def __init__(self, cfg, *, factory: str = "bullet_trt.serving.modes:create_engine",
                 engine_kwargs: dict | None = None, on_stats: StatsCallback | None = None,
                 on_death: Callable[[str], None] | None = None, stats_interval: float = 0.05,
                 num_threads: int = 0, start_timeout: float = 600.0, server_pid: int | None = None):
        self.cfg = cfg
        self._factory = factory
        self._engine_kwargs = dict(engine_kwargs or {})
        self._on_stats = on_stats
        self._on_death = on_death
        self._stats_interval = stats_interval
        self._num_threads = num_threads
        self._start_timeout = start_timeout
        self._server_pid = server_pid
        self._lock = threading.Lock()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stats = EngineStats()
        self._ready = False
        self._stopping = False
        self._stopped_by_engine = False  # it stopped on SIGTERM (EngineStopped), not by failing
        self._failure: str | None = None
        self._proc = None
        self._reader: threading.Thread | None = None
        self.info: EngineInfo | None = None

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> "EngineClient":
        ctx = mp.get_context("spawn")
        # The spawn executable is process-wide; set it to an interpreter that can import us.
        ctx.set_executable(python_executable())
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        # Not a daemon: the engine may start worker processes of its own. It watches its
        # parent and exits when the parent is gone.
        self._proc = ctx.Process(target=_engine_main, name="bullet-engine", daemon=False,
                                 args=(self.cfg, self._factory, self._engine_kwargs, self._inbox,
                                       self._outbox, self._stats_interval, self._num_threads,
                                       self._server_pid))
        self._proc.start()
        deadline = time.monotonic() + self._start_timeout
        while True:
            try:
                msg = self._outbox.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineUnavailable(f"engine process exited during start-up (exit code {self._proc.exitcode})")
                if time.monotonic() > deadline:
                    self._kill()
                    raise EngineUnavailable(f"engine process not ready after {self._start_timeout:.0f} s")
                continue
            if isinstance(msg, EngineReady):
                self.info = msg.info
                self._stats = self.info.stats
                break
            if isinstance(msg, EngineFailed):
                self._proc.join(timeout=10)
                raise EngineUnavailable(f"engine failed to start:\n{msg.trace}")
        self._ready = True
        self._reader = threading.Thread(target=self._read_loop, name="bullet-engine-reader", daemon=True)
        self._reader.start()
        if self._on_stats:
            self._on_stats(self._stats)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def failure(self) -> str | None:
        return self._failure

    def is_ready(self) -> bool:
        return self._ready and self._proc is not None and self._proc.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._callbacks)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: NewRequest, callback: OutputCallback) -> None:
        with self._lock:
            if not self._ready:
                raise EngineUnavailable(self._failure or "engine is not running")
            if request.request_id in self._callbacks:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._callbacks[request.request_id] = callback
        try:
            self._inbox.put(AddRequest(request))
        except Exception as e:
            with self._lock:
                self._callbacks.pop(request.request_id, None)
            raise EngineUnavailable(f"cannot reach the engine process: {e}") from e

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._ready or request_id not in self._callbacks:
                return
        try:
            self._inbox.put(AbortRequest(request_id))
        except Exception:
            pass

    # -- reader thread --------------------------------------------------------------------
    def _dispatch(self, out: RequestOutput) -> None:
        with self._lock:
            cb = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            log.exception("output callback of request %s failed", out.request_id)

    def _set_stats(self, stats: EngineStats) -> None:
        self._stats = stats
        if self._on_stats:
            try:
                self._on_stats(stats)
            except Exception:
                log.exception("stats callback failed")

    def _handle(self, msg) -> None:
        match msg:
            case StepOutputs(outputs=outputs, stats=stats):
                # Stats first: a client that has its final response and then reads the
                # metrics finds its request's blocks already counted free.
                self._set_stats(stats)
                for out in outputs:
                    self._dispatch(out)
            case StatsUpdate(stats=stats):
                self._set_stats(stats)
            case EngineFailed(trace=trace):
                lines = trace.strip().splitlines()
                self._failure = f"engine failed: {lines[-1] if lines else 'unknown error'}"
                log.error("engine process failed:\n%s", trace)
            case EngineStopped(reason=reason):
                self._failure = reason
                self._stopped_by_engine = True
                log.info("engine process stopped: %s", reason)

    def _read_loop(self) -> None:
        watch = StallWatch.from_env("engine reader")
        while True:
            try:
                msg = self._outbox.get(timeout=0.2)
            except queue.Empty:
                if self._proc.is_alive():
                    continue
                # The process is gone: take what it managed to send, then fail the rest.
                self._drain()
                break
            except (EOFError, OSError):
                break
            if watch:
                watch.begin()
            handled = self._handle_backlog(msg)
            if watch:
                watch.end(messages=handled, in_flight=self.num_in_flight())
        if watch:
            watch.close()
        with self._lock:
            self._ready = False
        self._kill_group()
        code = self._proc.exitcode
        if self._stopping:
            reason = "engine is shutting down"
        else:
            reason = self._failure or f"engine process died (exit code {code})"
            self._failure = reason
        self._fail_all(reason, "shutdown" if self._stopping or self._stopped_by_engine else "error")
        if not self._stopping and self._on_death:
            try:
                self._on_death(reason)
            except Exception:
                log.exception("death callback failed")

    def _handle_backlog(self, msg) -> int:
        """Handles ``msg`` and every message already waiting behind it, with each request's
        outputs merged: when the callbacks (detokenizing, sending responses) fall behind the
        engine's steps, a request gets one response for several tokens instead of a queue of
        one-token responses that delays all of them."""
        msgs = [msg]
        while len(msgs) < 256:
            try:
                msgs.append(self._outbox.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break
        steps = [m for m in msgs if isinstance(m, StepOutputs)]
        for m in msgs:
            if not isinstance(m, StepOutputs):
                self._handle(m)
        if steps:
            self._handle(StepOutputs(coalesce([out for m in steps for out in m.outputs]), steps[-1].stats))
        return len(msgs)

    def _drain(self) -> None:
        while True:
            try:
                msg = self._outbox.get(timeout=0.05)
            except (queue.Empty, EOFError, OSError):
                return
            self._handle(msg)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._lock:
            pending = list(self._callbacks.items())
            self._callbacks.clear()
        for rid, cb in pending:
            try:
                cb(RequestOutput(rid, [], finished=True, finish_reason=reason, error=message))
            except Exception:
                log.exception("output callback of request %s failed", rid)

    # -- shutdown -------------------------------------------------------------------------
    def _kill_group(self) -> None:
        """Kills what is left of the engine's process group (its workers) once it is gone."""
        info = self.info
        if info is None or info.pgid != info.pid or self._proc is None or self._proc.is_alive():
            return
        try:
            os.killpg(info.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        self._stopping = True
        with self._lock:
            self._ready = False
        if self._proc.is_alive():
            try:
                self._inbox.put(Shutdown())
            except Exception:
                pass
            self._proc.join(timeout=timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5)
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._kill_group()
        self._fail_all("engine is shutting down", "shutdown")
        for q in (getattr(self, "_inbox", None), getattr(self, "_outbox", None)):
            if q is not None:
                q.close()
                q.cancel_join_thread()
