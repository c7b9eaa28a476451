"""A step that raises: whether the engine can go on, and what its requests are told.

A step can fail with the device still sound: out of memory under a burst of long prompts, an
input that got past validation. Then only the requests of that step end, each with the error,
and the engine serves the others and the next arrivals. A device whose context is broken (an
illegal address, a device-side assert) fails every later step too, and so do steps that fail
for a cause that does not go away. In both cases the process must end, so that the server
reports not ready and can be restarted, instead of answering every request with an error.
"""
from __future__ import annotations

import sys

# Steps of one kind that may fail one after another before the engine gives up: one failure
# is a burst or a bad request; several in a row with nothing succeeding between them is a
# broken engine.
MAX_CONSECUTIVE_FAILURES = 3


class StepsKeepFailing(RuntimeError):
    pass


def device_usable(device) -> bool:
    """False when the device's context is broken: after a sticky CUDA error every later
    call fails, synchronize included."""
    if device.type != "cuda":
        return True
    import torch
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def last_line(trace: str) -> str:
    """The exception line of a formatted traceback."""
    return next((line for line in reversed(trace.strip().splitlines()) if line.strip()), "unknown error")


def report(what: str, num_requests: int, trace: str) -> None:
    print(f"bullet-trt: a {what} step of {num_requests} requests failed; they end with an error, "
          f"the rest go on:\n{trace}", file=sys.stderr, flush=True)


class FailureStreak:
    """Counts failed steps of one kind since the last one that succeeded."""

    def __init__(self, what: str, limit: int = MAX_CONSECUTIVE_FAILURES):
        self.what = what
        self.limit = limit
        self.count = 0

    def failed(self, reason: str) -> None:
        self.count += 1
        if self.count >= self.limit:
            raise StepsKeepFailing(f"{self.count} {self.what} steps failed in a row, the last with: {reason}")

    def succeeded(self) -> None:
        self.count = 0
