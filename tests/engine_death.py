"""The engine-death scenario against the real tritonserver: a server's engine process is
killed while many streams are open and new requests keep arriving. What docs/serving.md
(Health) promises, and `Report.problems()` checks:

  - tritonserver is still running;
  - every request ended, with its final response or an error (none left hanging);
  - the requests in flight at the kill got "engine process died ...";
  - the model reports not ready (it unloads itself under --model-control-mode=explicit).

tritonserver 2.51 used to die of a segmentation fault here (two threads counting one custom
metric at once). `run()` starts the server (the nvidia-pytriton wheel's) on free ports with the
tiny random engine (engines/tiny-random), or `engine_dir`, in `mode`;
tests/test_engine_death.py runs it on CPU.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bullet_trt.serving.triton import process_tree


class Group:
    """Requests over a few gRPC bidirectional streams (one client each).

    Triton's gRPC stream reports an error without the request's id (only a final response
    carries it). The model's errors name their request in the message
    (bullet_trt/serving/triton/request_errors.py), but Triton's own refusal of a request for
    the model once it has unloaded names none, so errors are counted per stream: each request
    ends with exactly one final response or one error, and a stream whose requests are all
    accounted for has as many errors as requests without a final response.
    """

    def __init__(self, url: str, connections: int, model: str):
        import tritonclient.grpc as grpcclient

        self.model = model
        self._lock = threading.Lock()
        self.started: queue.Queue = queue.Queue()  # ids of requests with their first response
        self.requests: list[list[str]] = [[] for _ in range(connections)]
        self.responses: dict[str, int] = {}
        self.final: set[str] = set()
        self.errors: list[list[str]] = [[] for _ in range(connections)]
        self.clients = []
        for k in range(connections):
            c = grpcclient.InferenceServerClient(url)
            c.start_stream(callback=lambda result, error, k=k: self._callback(k, result, error))
            self.clients.append(c)
        self._n = 0

    def _callback(self, k: int, result, error) -> None:
        with self._lock:
            if error is not None:
                self.errors[k].append(error.message() if hasattr(error, "message") else str(error))
                return
            resp = result.get_response()
            n = self.responses[resp.id] = self.responses.get(resp.id, 0) + 1
            if n == 1:
                self.started.put(resp.id)
            p = resp.parameters
            if "triton_final_response" in p and p["triton_final_response"].bool_param:
                self.final.add(resp.id)

    def send(self, prompt: str, max_tokens: int, prefix: str) -> str:
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, value, dt, np_dt in (("text_input", prompt.encode(), "BYTES", np.object_),
                                       ("max_tokens", max_tokens, "INT32", np.int32),
                                       ("min_tokens", max_tokens, "INT32", np.int32),
                                       ("stream", True, "BOOL", np.bool_)):
            i = grpcclient.InferInput(name, [1, 1], dt)
            i.set_data_from_numpy(np.array([[value]], dtype=np_dt))
            inputs.append(i)
        with self._lock:
            k = self._n % len(self.clients)
            self._n += 1
            rid = f"{prefix}{self._n}"
            self.requests[k].append(rid)
        try:
            self.clients[k].async_stream_infer(self.model, inputs, request_id=rid,
                                               enable_empty_final_response=True)
        except Exception as e:  # the stream is already broken (server gone)
            with self._lock:
                self.errors[k].append(f"client: {e}")
        return rid

    def count(self) -> dict:
        """requests, final, errors, hanging (neither yet) and extra (more errors than requests
        left without a final: the stream broke)."""
        with self._lock:
            out = {"requests": 0, "final": 0, "errors": 0, "hanging": 0, "extra": 0}
            for k, rids in enumerate(self.requests):
                final = sum(1 for r in rids if r in self.final)
                errors = len(self.errors[k])
                out["requests"] += len(rids)
                out["final"] += final
                out["errors"] += errors
                out["hanging"] += max(0, len(rids) - final - errors)
                out["extra"] += max(0, errors - (len(rids) - final))
            return out

    def all_errors(self) -> list[str]:
        with self._lock:
            return [e for errs in self.errors for e in errs]

    def close(self) -> None:
        for c in self.clients:
            try:
                c.stop_stream(cancel_requests=True)
                c.close()
            except Exception:
                pass


@dataclass
class Report:
    server_exit: int | None             # None: still running after the scenario
    model_ready_after: bool | None       # None: could not ask (server gone)
    in_flight: dict                      # Group.count() of the streams open at the kill
    arrivals: dict                       # Group.count() of the requests sent from just before it
    in_flight_errors: list[str]
    arrival_errors: list[str]
    log_file: Path
    crash_lines: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        if self.server_exit is not None:
            out.append(f"tritonserver exited with {self.server_exit}")
        if self.model_ready_after is not False:
            out.append(f"the model's readiness after its engine died: {self.model_ready_after} (want False)")
        for name, c in (("in-flight", self.in_flight), ("arriving", self.arrivals)):
            if c["hanging"]:
                out.append(f"{c['hanging']} of {c['requests']} {name} requests got neither a final "
                           f"response nor an error")
            if c["extra"]:
                out.append(f"{c['extra']} errors beyond one per {name} request (a stream broke)")
        died = [e for e in self.in_flight_errors if "engine process died" in e]
        if not died:
            out.append("no open stream got 'engine process died': nothing was in flight at the kill")
        other = [e for e in self.in_flight_errors if "engine process died" not in e]
        if other:
            out.append(f"{len(other)} in-flight requests ended with another error than 'engine process "
                       f"died', e.g. {other[:3]}")
        out.extend(f"server log: {line}" for line in self.crash_lines)
        return out

    def summary(self) -> str:
        def fmt(c):
            return f"{c['requests']} ({c['final']} final, {c['errors']} errors, {c['hanging']} hanging)"
        kinds = sorted({re.sub(r"\(exit code -?\d+\)|'[^']*'", "", e)[:100] for e in self.arrival_errors})
        return (f"server: {'running' if self.server_exit is None else f'exited with {self.server_exit}'}; "
                f"model ready after: {self.model_ready_after}; in flight at the kill: {fmt(self.in_flight)}; "
                f"arrivals: {fmt(self.arrivals)}; arrival errors: {kinds}; log: {self.log_file}")


CRASH_PATTERNS = re.compile(r"Segmentation fault|SIGSEGV|Signal \(11\)|Signal \(6\)|lock_exception|"
                            r"Stub process .* is not healthy|terminate called", re.IGNORECASE)


def engine_pid(server_pid: int) -> int:
    pids = process_tree.engine_pids(server_pid)
    if not pids:
        raise RuntimeError(f"no engine process under tritonserver {server_pid}: "
                           f"{process_tree.descendants(server_pid)}")
    return pids[0]


def _model_ready(url: str, model: str) -> bool | None:
    import tritonclient.http as httpclient

    try:
        c = httpclient.InferenceServerClient(url)
        try:
            return c.is_model_ready(model)
        finally:
            c.close()
    except Exception:
        return None


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def run(*, streams: int = 150, interval_ms: float = 10.0, arrive_before_s: float = 0.3,
        arrive_after_s: float = 3.0, max_tokens: int = 1000, arrival_max_tokens: int = 16,
        connections: int = 4, mode: str = "bullet", engine_dir: str | Path | None = None,
        overrides: dict | None = None, log_file: Path | None = None, log_verbose: int = 0,
        start_timeout_s: float = 300.0, end_timeout_s: float = 120.0, model: str = "bullet",
        echo=print) -> Report:
    """The scenario; returns what happened (the server is stopped before it returns)."""
    from bullet_trt.serving.triton import server as srv

    if engine_dir is None:
        from bullet_trt.tools.build import TINY_RANDOM_ENGINE_DIR, build_tiny_random_engine
        engine_dir = build_tiny_random_engine(TINY_RANDOM_ENGINE_DIR)
    if log_file is None:
        log_file = Path(tempfile.mkdtemp(prefix="engine-death-")) / "tritonserver.log"
    ports = srv.free_ports(3)
    http_url, grpc_url = f"localhost:{ports[0]}", f"localhost:{ports[1]}"
    ov = {"serve.mode": mode, **(overrides or {})}
    proc = srv.launch(engine_dir=engine_dir, overrides=ov, log_file=log_file, http_port=ports[0],
                      grpc_port=ports[1], metrics_port=ports[2], log_verbose=log_verbose)

    def log_tail():
        try:
            return "\n".join(log_file.read_text(errors="replace").splitlines()[-60:])
        except OSError:
            return ""

    groups: list[Group] = []
    try:
        srv.wait_until_ready(proc, grpc_url, start_timeout_s, model, log_tail, http_url=http_url)
        try:  # tritonserver prints raw addresses when it crashes; the maps resolve them
            (log_file.parent / f"{log_file.name}.maps").write_text(Path(f"/proc/{proc.pid}/maps").read_text())
        except OSError:
            pass
        # Separate streams for the two kinds of request, so that errors (which carry no request
        # id) can be told apart.
        open_streams = Group(grpc_url, connections, model)
        arriving = Group(grpc_url, connections, model)
        groups += [open_streams, arriving]
        echo(f"server up (pid {proc.pid}); opening {streams} streams")
        for i in range(streams):
            open_streams.send(f"Stream {i} keeps going", max_tokens, "s")
        # Streams beyond the engine's batch wait in its queue without producing text: wait
        # until every stream has text or starts have stopped coming for a second.
        started = 0
        deadline = time.monotonic() + end_timeout_s
        quiet_since = time.monotonic()
        while started < streams and (not started or time.monotonic() - quiet_since < 1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"only {started} of {streams} streams started:\n{log_tail()}")
            try:
                open_streams.started.get(timeout=0.2)
                started += 1
                quiet_since = time.monotonic()
            except queue.Empty:
                pass
        echo(f"{streams} streams open ({started} producing text); arrivals every {interval_ms:g} ms, "
             f"then SIGKILL to the engine")

        stop = threading.Event()

        def arrive():
            n = 0
            while not stop.is_set() and proc.poll() is None:
                arriving.send(f"Arrival {n}", arrival_max_tokens, "a")
                n += 1
                stop.wait(interval_ms / 1000.0)

        t = threading.Thread(target=arrive, daemon=True)
        t.start()
        time.sleep(arrive_before_s)
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGKILL)
        echo(f"killed engine process {pid}")
        time.sleep(arrive_after_s)
        stop.set()
        t.join()
        echo(f"{arriving.count()['requests']} arrivals sent; waiting for every request to end")

        _wait(lambda: proc.poll() is not None or not any(g.count()["hanging"] for g in groups), end_timeout_s)
        ready = None
        if proc.poll() is None:
            _wait(lambda: _model_ready(http_url, model) is False or proc.poll() is not None, 60)
            ready = _model_ready(http_url, model)
        exit_code = proc.poll()
        crash = [line for line in log_tail().splitlines() if CRASH_PATTERNS.search(line)]
        return Report(exit_code, ready, open_streams.count(), arriving.count(), open_streams.all_errors(),
                      arriving.all_errors(), log_file, crash)
    finally:
        for g in groups:
            g.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
