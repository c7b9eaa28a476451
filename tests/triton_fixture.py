"""Starts the real tritonserver (from the nvidia-pytriton wheel) on free ports, serving
model_repository/ with the tiny random engine, and helpers to talk to it."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bullet_trt.serving.supervisor import stop_server
from bullet_trt.serving.triton import process_tree

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


# Crashes inside the tritonserver binary (2.51, as nvidia-pytriton ships it), outside this
# project's code; docs/serving.md (Health) describes both. A test that finds its server dead
# with every mark of one of them in the log reports an expected failure; any other death fails.
KNOWN_SERVER_CRASHES = {
    "gRPC stream write race (proto_buffer_writer.h:65 assertion)":
        ("proto_buffer_writer.h:65]", "ASSERTION FAILED: !byte_buffer->Valid()"),
    "gRPC stream cancellation race (HandleCancellation on a context not cancelled, then SIGSEGV)":
        ("HandleCancellation called even when the context was not cancelled", "Signal (11) received"),
}


def known_server_crash(log_text: str) -> str | None:
    """The name of the known tritonserver crash whose marks are all in `log_text`, if any."""
    return next((name for name, marks in KNOWN_SERVER_CRASHES.items()
                 if all(mark in log_text for mark in marks)), None)


def ensure_tiny_random_engine() -> Path:
    """engines/tiny-random: server tests need answers in milliseconds per token, not sense."""
    from bullet_trt.tools.build import TINY_RANDOM_ENGINE_DIR, build_tiny_random_engine
    return build_tiny_random_engine(TINY_RANDOM_ENGINE_DIR)


@dataclass
class TritonServer:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_file: Path
    model: str = "bullet"
    _clients: list = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines if not line.startswith(("|", "+")))[-8000:] if n else ""

    # -- plain HTTP ---------------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout: float = 60.0) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def generate(self, body: dict) -> tuple[int, dict]:
        status, data = self.post(f"/v2/models/{self.model}/generate", body)
        return status, json.loads(data)

    def generate_stream(self, body: dict) -> list[dict]:
        """Server-sent events of /generate_stream, decoded."""
        status, data = self.post(f"/v2/models/{self.model}/generate_stream", body)
        events = [json.loads(line[len("data:"):]) for line in data.decode().splitlines()
                  if line.startswith("data:")]
        if status != 200 and not events:
            raise AssertionError(f"generate_stream answered {status}: {data[:500]!r}")
        return events

    def known_crash(self) -> str | None:
        """The known tritonserver crash that ended this server, if it ended by one. Its clients
        see their streams drop while the dying server still prints its backtrace, so a crash
        logged is waited for (briefly) rather than taken as "still running"."""
        crash = known_server_crash(self.log_file.read_text(errors="replace"))
        if crash is None:
            return None
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None
        return crash

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, scraped: str | None = None, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`, in `scraped` (the text of
        one scrape) or a new scrape."""
        total, found = 0.0, False
        for line in (scraped if scraped is not None else self.metrics_text()).splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == str(v) for k, v in labels.items()):
                total += float(m.group(3))
                found = True
        if not found:
            raise KeyError(f"metric {name}{labels or ''} not exposed")
        return total

    def kv_blocks_total(self, timeout: float = 30.0) -> float:
        """The KV pool's size, as free + used blocks. Two scrapes, one per gauge, can straddle a
        stats update (a finished request's blocks freed between them) and add up to a total the
        pool never shows again; even one scrape can fall between the backend setting the two
        gauges. So both come from one scrape, and two scrapes in a row must agree."""
        previous, deadline = None, time.monotonic() + timeout
        while True:
            scraped = self.metrics_text()
            total = self.metric("bullet_kv_blocks_free", scraped) + self.metric("bullet_kv_blocks_used", scraped)
            if total == previous:
                return total
            if time.monotonic() > deadline:
                raise AssertionError(f"free + used KV blocks did not settle in {timeout:.0f} s")
            previous = total
            time.sleep(0.05)

    def stop(self) -> None:
        stop_server(self.proc)

    def descendants(self) -> list[tuple[int, int, str]]:
        """(pid, parent pid, command line) of every process below the server."""
        return process_tree.descendants(self.proc.pid)

    def engine_pids(self) -> list[int]:
        """The engine process (the stub's multiprocessing child) and any workers it started."""
        return process_tree.engine_pids(self.proc.pid)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def start_server(tmp_dir: Path, name: str = "server", overrides: dict | None = None,
                 engine_dir: Path | None = None) -> TritonServer:
    """Launches tritonserver and waits until the model is ready (or fails with its log)."""
    from bullet_trt.serving.triton import server as srv

    engine_dir = engine_dir or ensure_tiny_random_engine()
    log_file = tmp_dir / f"{name}.log"

    def start(ports: list[int]) -> TritonServer:
        proc = srv.launch(engine_dir=engine_dir, overrides=overrides, log_file=log_file, http_port=ports[0],
                          grpc_port=ports[1], metrics_port=ports[2])
        server = TritonServer(proc, *ports, log_file=log_file)
        try:
            srv.wait_until_ready(proc, server.grpc_url, START_TIMEOUT_S, server.model, server.log_tail,
                                 http_url=server.http_url)
        except srv.ServerNotReady:
            server.stop()
            raise
        return server
    return srv.on_free_ports(3, start)


def module_server(tmp_dir: Path, **start_kwargs):
    """A module-scoped fixture's body (``yield from``): a started server, then, once the module
    is done, the server stopped and every process below it (engine, workers, ranks) gone."""
    from tests.polling import wait_for

    server = start_server(tmp_dir, **start_kwargs)
    engine_pids = server.engine_pids()
    yield server
    server.stop()
    wait_for(lambda: not any(pid_alive(p) for p in engine_pids), what="the engine processes exit", timeout=30)


# -- gRPC streaming helpers ---------------------------------------------------------------------

NP_TYPES = {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
DEFAULT_TYPES = {
    "text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32",
    "top_k": "INT32", "seed": "UINT64", "random_seed": "UINT64", "stop_words": "BYTES", "bad_words": "BYTES",
    "end_id": "INT32", "pad_id": "INT32", "min_tokens": "INT32", "min_length": "INT32",
    "exclude_input_in_output": "BOOL", "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL",
    "return_log_probs": "BOOL",
}


def grpc_inputs(fields: dict, types: dict | None = None, shapes: dict | None = None):
    """InferInputs with the batch dimension: a scalar becomes [1, 1], a list [1, n]."""
    import tritonclient.grpc as grpcclient

    out = []
    for name, value in fields.items():
        dt = (types or {}).get(name) or DEFAULT_TYPES.get(name, "BYTES")
        arr = np.array(value if isinstance(value, list) else [value], dtype=NP_TYPES[dt])
        arr = arr.reshape((shapes or {}).get(name) or (1, -1))
        i = grpcclient.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


@dataclass
class StreamResult:
    pieces: list[str] = field(default_factory=list)
    responses: list = field(default_factory=list)
    error: str | None = None
    error_status: str | None = None  # e.g. "StatusCode.UNAVAILABLE", with triton_grpc_error=True
    final: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class GrpcStreams:
    """Many requests over one gRPC bidirectional stream, demultiplexed by request id.

    triton_grpc_error=True: an error ends the stream with the error's own status code
    (Triton's ``triton_grpc_error`` header) instead of a message inside the stream; send one
    request per stream then."""

    def __init__(self, url: str, triton_grpc_error: bool = False):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.events: dict[str, queue.Queue] = {}
        self.client.start_stream(callback=self._callback,
                                 headers={"triton_grpc_error": "true"} if triton_grpc_error else None)
        self._n = 0

    def _callback(self, result, error):
        if error is not None:
            rid = self._error_request_id(error)
            self.events.setdefault(rid, queue.Queue()).put(("error", error))
        else:
            rid = result.get_response().id
            self.events.setdefault(rid, queue.Queue()).put(("result", result))

    @staticmethod
    def _error_request_id(error) -> str:
        from bullet_trt.serving.triton.request_errors import split_request_id
        message = error.message() if hasattr(error, "message") else str(error)
        return split_request_id(message or "")[0] or "?"

    def send(self, fields: dict, model: str = "bullet", types=None, shapes=None, raw_inputs=None) -> str:
        self._n += 1
        rid = f"t{self._n}"
        self.events.setdefault(rid, queue.Queue())
        inputs = raw_inputs if raw_inputs is not None else grpc_inputs(fields, types, shapes)
        self.client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)
        return rid

    def first(self, rid: str, timeout: float = 60.0):
        return self._next(rid, timeout)

    def _next(self, rid: str, timeout: float):
        """The next event of `rid`; errors whose message lacks the request id count too
        (tests that expect errors send one request at a time)."""
        deadline = time.monotonic() + timeout
        queues = [self.events[rid], self.events.setdefault("?", queue.Queue())]
        while True:
            for q in queues:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no response for request {rid} within {timeout} s")
            time.sleep(0.005)

    def collect(self, rid: str, timeout: float = 120.0) -> StreamResult:
        res = StreamResult()
        while True:
            kind, item = self._next(rid, timeout)
            if kind == "error":
                res.error = item.message() if hasattr(item, "message") else str(item)
                res.error_status = item.status() if hasattr(item, "status") else None
                return res
            res.responses.append(item)
            out = item.as_numpy("text_output")
            if out is not None:
                res.pieces.extend(x.decode("utf-8") for x in out.reshape(-1))
            params = item.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                res.final = True
                return res

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


class FakeCore:
    """An engine for EngineClient tests: one token (the step number) per running request per
    step; a prompt starting with 666 makes the step raise, one starting with 667 kills the
    process."""

    def __init__(self, cfg, **kwargs):
        from bullet_trt.engine.request import EngineStats
        self._stats_cls = EngineStats
        self.cfg = cfg
        self.reqs: dict = {}
        self.aborted: list[str] = []
        self.tokens = 0

    def add_request(self, req):
        from bullet_trt.engine.validation import RequestLimits, validate_prompt
        validate_prompt(req.prompt_token_ids, RequestLimits(self.cfg.max_model_len))
        self.reqs[req.request_id] = [req, 0]

    def abort_request(self, rid):
        self.aborted.append(rid)

    def has_unfinished(self):
        return bool(self.reqs)

    def stats(self):
        return self._stats_cls(num_waiting=0, num_running=len(self.reqs), kv_blocks_total=10,
                               kv_blocks_free=10 - len(self.reqs), tokens_generated=self.tokens)

    def step(self):
        from bullet_trt.engine.request import RequestOutput
        outs = []
        for rid in self.aborted:
            if self.reqs.pop(rid, None) is not None:
                outs.append(RequestOutput(rid, [], finished=True, finish_reason="abort"))
        self.aborted.clear()
        for rid, entry in list(self.reqs.items()):
            req, n = entry
            if req.prompt_token_ids[0] == 666:
                raise RuntimeError("boom: the fake engine failed")
            if req.prompt_token_ids[0] == 667:
                os._exit(3)
            entry[1] = n + 1
            self.tokens += 1
            done = entry[1] >= req.params.max_tokens
            outs.append(RequestOutput(rid, [n], finished=done, finish_reason="length" if done else None,
                                      num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=n + 1))
            if done:
                del self.reqs[rid]
        time.sleep(0.002)
        return outs
