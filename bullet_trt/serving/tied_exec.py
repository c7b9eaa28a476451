"""A command that dies with the process that starts it, whatever way that process dies.

Linux sends a child a signal of its choosing when its parent dies (PR_SET_PDEATHSIG), but the
child must ask for it itself, between fork and exec: tritonserver does not. So the command
runs behind a few lines of Python that ask for it and then exec the command in place (same
pid, same process group); the setting survives the exec. Nothing to do with threads in the
parent, unlike a preexec_fn. The signal is sent when the *thread* that started the child
exits, so start tied children from the thread that lives as long as the process (the main one).
"""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

_TIE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_PDEATHSIG}, int(sys.argv[1]), 0, 0, 0) != 0:\n"
    "    raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit(1)  # the parent died before the signal was asked for\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def tied_command(cmd: list[str], death_signal: int = signal.SIGKILL) -> list[str]:
    """`cmd` behind the tie; unchanged where the kernel offers no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _TIE, str(int(death_signal)), str(os.getpid()), *cmd]
