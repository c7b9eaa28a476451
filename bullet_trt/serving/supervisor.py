"""Every process `bullet-trt serve` and `bullet-trt demo` start, and how they stop together.

    sup = Supervisor()
    sup.handle_signals()                                   # SIGTERM and Ctrl-C stop everything
    sup.start("tritonserver", cmd, env=env, drain=stop_engines)
    sup.adopt("openai", launch(...), essential=False)      # a child started elsewhere
    sup.on_stop(lambda: stop_mps_daemon(...))              # cleanup once the children are gone
    return sup.wait()                                      # until a signal or an essential child ends

Stopping, whatever asked for it (a signal, a child that ended, an exception), goes:

1. drain: each child's hook lets its work end with an answer; tritonserver's asks the engine
   processes to stop, and they end every open request with "server is shutting down" (the
   streams get a final error, the KV blocks return) and exit. Up to `drain_s`.
2. SIGTERM to each child, the last started first.
   Up to `grace_s`: tritonserver's own shutdown waits for clients to close their streams, and
   2.51 was seen to hang after its exit timeout, so nothing waits on it longer.
3. SIGKILL to what is left: the children, their groups, and every process that was below a
   child when stopping began (the engine and its workers form a process group of their own).
   Listening sockets close with their process, so the ports are free again.

Children started here get a session of their own, so a terminal's Ctrl-C reaches this process
only and the order above holds, and they die with this process (tied_exec.py): a SIGKILL here
leaves no server holding the ports or the GPU. The engine watches its parent (the Python
backend's stub, which exits with tritonserver) and its workers watch the engine.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bullet_trt.serving.tied_exec import tied_command
from bullet_trt.serving.triton.process_tree import descendants, stop_engines

log = logging.getLogger("bullet_trt.supervisor")

# Called with the child's pid when stopping begins; returns the pids whose exit to wait for.
Drain = Callable[[int], "list[int] | None"]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    drain: Drain | None
    essential: bool  # its end ends the supervision

    @property
    def own_group(self) -> bool:
        try:
            return os.getpgid(self.proc.pid) == self.proc.pid
        except ProcessLookupError:
            return False

    def signal(self, sig: int, group: bool = False) -> None:
        """To the child, or with group=True to its whole process group when it has its own."""
        try:
            if group and self.own_group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process
    (a pid may be reused once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Supervisor:
    def __init__(self, drain_s: float = 5.0, grace_s: float = 5.0):
        self.drain_s = drain_s
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.signal_received: int | None = None
        self._cleanups: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._interrupt = False
        self._stopped = False

    # -- children -----------------------------------------------------------------------------
    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
              log_file: str | Path | None = None, drain: Drain | None = None, essential: bool = True,
              death_signal: int = signal.SIGKILL) -> subprocess.Popen:
        """Starts `cmd` in a session of its own, tied to this process's life; its output goes
        to `log_file` (appended), else to ours."""
        out = open(log_file, "ab") if log_file else None
        try:
            proc = subprocess.Popen(tied_command(cmd, death_signal), env=env, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT if out else None, start_new_session=True)
        finally:
            if out:
                out.close()
        return self.adopt(name, proc, drain, essential)

    def adopt(self, name: str, proc: subprocess.Popen, drain: Drain | None = None,
              essential: bool = True) -> subprocess.Popen:
        """A child started elsewhere (the OpenAI front end's launch), stopped with the others."""
        self.children.append(Child(name, proc, drain, essential))
        return proc

    def on_stop(self, cleanup: Callable[[], None]) -> None:
        """Runs once every child is gone (the last registered first)."""
        self._cleanups.append(cleanup)

    # -- signals ------------------------------------------------------------------------------
    def handle_signals(self, interrupt: bool = False) -> None:
        """SIGTERM and SIGINT stop everything. interrupt=True also raises KeyboardInterrupt in
        the main thread, for a caller busy with other work (the demo's request)."""
        self._interrupt = interrupt
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.signal_received is None:
            self.signal_received = signum
        self._wake.set()
        if self._interrupt and not self._stopped:
            raise KeyboardInterrupt

    # -- waiting and stopping -----------------------------------------------------------------
    def wait(self) -> int:
        """Blocks until a signal arrives or an essential child ends, then stops everything.
        Returns 0 after a signal, else the exit status of the child that ended."""
        ended = None
        while ended is None and self.signal_received is None:
            ended = next((c for c in self.children if c.essential and c.proc.poll() is not None), None)
            if ended is None:
                self._wake.wait(0.2)
        if ended is not None:
            log.warning("%s exited with %s; stopping the others", ended.name, ended.proc.returncode)
        self.stop()
        return 0 if ended is None else (ended.proc.returncode or 0)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True  # a second Ctrl-C from here on is noted, not raised
        alive = [c for c in self.children if c.proc.poll() is None]
        below = [(pid, _start_time(pid)) for c in alive for pid, _, _ in descendants(c.proc.pid)]
        asked: list[int] = []
        for c in reversed(alive):
            if c.drain is not None:
                try:
                    asked += list(c.drain(c.proc.pid) or [])
                except Exception:  # noqa: BLE001 - stopping goes on whatever a hook does
                    log.exception("draining %s failed", c.name)
        self._until(lambda: not any(_alive(pid) for pid in asked), self.drain_s)
        for c in reversed(alive):
            c.signal(signal.SIGTERM)
        self._until(lambda: all(c.proc.poll() is not None for c in alive), self.grace_s)
        for c in alive:
            if c.proc.poll() is None:
                log.warning("%s did not stop within %g s; killing it", c.name, self.grace_s)
            c.signal(signal.SIGKILL, group=True)  # the group too: a stub the leader leaves behind
        for c in alive:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", c.name, c.proc.pid)
        for pid, started in below:
            if started is not None and _start_time(pid) == started and _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001
                log.exception("cleanup after stopping failed")

    @staticmethod
    def _until(done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_server(proc: subprocess.Popen) -> None:
    """Stops a tritonserver started without a supervisor (serving.triton.server.launch: tests,
    benchmarks) the way `bullet-trt serve` stops its own: the engines end their open requests
    first, then SIGTERM, then SIGKILL to the server and to every process that was below it (the
    engine and its workers are a process group of their own, which a signal to the server's
    group misses)."""
    sup = Supervisor()
    sup.adopt("tritonserver", proc, drain=stop_engines)
    sup.stop()
