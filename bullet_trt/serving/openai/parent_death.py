"""Ends this process when the process that started it dies, whatever way it dies (SIGKILL
included), so that no front end outlives the server it fronts."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` when the parent goes; elsewhere a thread polls for it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_poll, args=(parent_pid, sig), name="parent-watch", daemon=True).start()
    # The parent may have died before prctl took effect; then this process has been re-parented.
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _poll(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        threading.Event().wait(1.0)
    os.kill(os.getpid(), sig)
