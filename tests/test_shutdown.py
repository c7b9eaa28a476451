"""`bullet-trt serve` and `bullet-trt demo` stop everything they started: SIGTERM or Ctrl-C
ends open streams with an error and leaves no process behind and every port free; a SIGKILL
to them leaves no process behind either. Real subprocesses, real signals, a tiny random engine."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bullet_trt.serving.triton import process_tree
from bullet_trt.serving.triton import server as srv
from tests.polling import wait_for
from tests.tiny_engine import HELD_TOKENS, LONG_CONTEXT, tiny_engine
from tests.triton_fixture import GrpcStreams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny") / "engine", max_model_len=LONG_CONTEXT)


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def running(procs: list[tuple[int, str | None, str]]) -> list[tuple[int, str]]:
    """Those of (pid, start time, command) still running (not a zombie) as the same process."""
    out = []
    for pid, started, cmd in procs:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and start_time(pid) == started:
            out.append((pid, cmd))
    return out


def tree(pid: int) -> list[tuple[int, str | None, str]]:
    return [(p, start_time(p), cmd) for p, _, cmd in process_tree.descendants(pid)]


def ports_bind(ports: list[int]) -> bool:
    """Every port binds again, as a restarted server binds it (SO_REUSEADDR, so connections
    of the old server still in TIME_WAIT do not count)."""
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def openai_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return json.loads(r.read()).get("status") == "ok"
    except OSError:
        return False


def start(command: str, engine_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, list[int], Path]:
    """`bullet-trt serve|demo` with the OpenAI front end, on free ports, ready to serve."""
    http, grpc, metrics, openai = ports = srv.free_ports(4)
    log = tmp_path / f"{command}.log"
    cmd = [sys.executable, "-m", "bullet_trt.tools.cli", command, "--engine-dir", str(engine_dir),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--openai-port", str(openai)]
    if command == "demo":
        cmd += ["--max-tokens", "8"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        srv.wait_until_ready(proc, f"127.0.0.1:{grpc}", 300, log_tail=lambda: log.read_text(errors="replace"),
                             http_url=f"127.0.0.1:{http}")
        wait_for(lambda: openai_ready(openai) or proc.poll() is not None, "the OpenAI front end")
        if command == "demo":
            wait_for(lambda: "demo: serving" in log.read_text(errors="replace") or proc.poll() is not None,
                     "the demo's sample request")
        assert proc.poll() is None, log.read_text(errors="replace")
    except BaseException:
        proc.kill()
        raise
    return proc, ports, log


def assert_everything_started(procs, log: Path) -> None:
    cmds = " | ".join(cmd for _, _, cmd in procs)
    for part in ("bin/tritonserver", "triton_python_backend_stub", "spawn_main", "bullet_trt.serving.openai"):
        assert part in cmds, f"{part} not among the processes started: {cmds}\n{log.read_text(errors='replace')}"


def test_sigterm_to_serve_ends_open_streams_and_every_process_and_frees_the_ports(engine_dir, tmp_path):
    proc, ports, log = start("serve", engine_dir, tmp_path)
    procs = tree(proc.pid)
    assert_everything_started(procs, log)
    s = GrpcStreams(f"127.0.0.1:{ports[1]}")
    try:
        rid = s.send({"text_input": "Never ending", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS,
                      "stream": True})
        assert s.first(rid)[0] == "result"
        proc.send_signal(signal.SIGTERM)
        res = s.collect(rid, timeout=60)
    finally:
        s.close()
    assert res.error is not None and "server is shutting down" in res.error, res.error
    assert res.error.startswith(f"[request id: {rid}] "), res.error  # the stream drops its id
    assert proc.wait(timeout=120) == 0, log.read_text(errors="replace")
    wait_for(lambda: not running(procs), f"no process left of {procs}")
    wait_for(lambda: ports_bind(ports), "the ports free again")


def test_sigkill_to_serve_leaves_no_process_behind(engine_dir, tmp_path):
    proc, ports, log = start("serve", engine_dir, tmp_path)
    procs = tree(proc.pid)
    assert_everything_started(procs, log)
    s = GrpcStreams(f"127.0.0.1:{ports[1]}")
    try:
        rid = s.send({"text_input": "Never ending", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS,
                      "stream": True})
        assert s.first(rid)[0] == "result"  # the engine is busy and a cancellation poll in flight
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not running(procs), f"no process left of {running(procs)}")
    finally:
        s.close()
    wait_for(lambda: ports_bind(ports), "the ports free again")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_stops_everything_it_started(engine_dir, tmp_path, sig):
    proc, ports, log = start("demo", engine_dir, tmp_path)
    procs = tree(proc.pid)
    assert_everything_started(procs, log)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0, log.read_text(errors="replace")
    wait_for(lambda: not running(procs), f"no process left of {procs}")
    wait_for(lambda: ports_bind(ports), "the ports free again")


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_benchmark_stopped_mid_sweep_leaves_no_server_behind(engine_dir, tmp_path, sig):
    """`timeout` stops a benchmark with SIGTERM; a scheduler may SIGKILL it. Either way the
    tritonserver it started, and that server's engine, must go with it: one left behind holds
    the GPU's memory and fails the next benchmark's start."""
    out = tmp_path / "bench"
    log = tmp_path / "bench.log"
    cmd = [sys.executable, "-m", "bullet_trt.tools.cli", "bench", "serve", "--start-server",
           "--engine-dir", str(engine_dir), "--modes", "chunked", "--dataset", "sharegpt", "--rates", "2",
           "--duration", "300", "--no-progress", "--no-plots", "--out", str(out)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        server_log = out / "server_chunked.log"
        wait_for(lambda: "Started GRPCInferenceService" in _text(server_log) or proc.poll() is not None,
                 "the benchmark's server", timeout=300)
        assert proc.poll() is None, _text(log) + _text(server_log)
        procs = wait_for(lambda: (lambda t: t if "spawn_main" in " | ".join(c for _, _, c in t) else None)(
            tree(proc.pid)), "the engine's processes")
        assert "bin/tritonserver" in " | ".join(cmd for _, _, cmd in procs)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        wait_for(lambda: not running(procs), f"no process left of {running(procs)}")
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGTERM:  # stopped as Ctrl-C stops it, saying where the results are
        assert proc.returncode == 130 and "interrupted" in _text(log), _text(log)
