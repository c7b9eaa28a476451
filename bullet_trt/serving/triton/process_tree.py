"""The processes below a running tritonserver, read from /proc (Linux).

The engine is the Python-backend stub's multiprocessing child, and its prefill and decode
workers are the engine's children. Health checks and tests find them here to kill or watch
them without asking the server, which may be the thing under test.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(root: int) -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every process below `root`."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we read
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        for pid in children.get(parent, []):
            try:
                cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append((pid, parent, cmd))
            todo.append(pid)
    return out


def _engines(procs: list[tuple[int, int, str]]) -> list[int]:
    stubs = {pid for pid, _, cmd in procs if "triton_python_backend_stub" in cmd}
    return [pid for pid, ppid, cmd in procs if "spawn_main" in cmd and ppid in stubs]


def engine_pids(server_pid: int) -> list[int]:
    """The engine process(es) below a tritonserver, then any workers they started."""
    procs = descendants(server_pid)
    engines = _engines(procs)
    workers = [pid for pid, ppid, cmd in procs if ppid in engines]
    return engines + workers


def stop_engines(server_pid: int) -> list[int]:
    """Asks each engine below a tritonserver to stop (SIGTERM): it ends every request it holds
    with "server is shutting down", stops its workers and exits. Returns the pids asked; a
    server shutting down does this first, so that open streams end with an answer rather than
    with tritonserver's own shutdown, which waits for clients to close their streams."""
    asked = []
    for pid in _engines(descendants(server_pid)):
        try:
            os.kill(pid, signal.SIGTERM)
            asked.append(pid)
        except ProcessLookupError:
            pass
    return asked
