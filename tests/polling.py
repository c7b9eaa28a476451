"""Waiting for a server or process to reach a state: tests assert states, never elapsed time,
so a bound here only turns a hang into a failure that says what never happened."""
from __future__ import annotations

import time


def wait_for(cond, what: str = "condition", timeout: float = 90.0, interval: float = 0.05):
    """cond's first truthy value; AssertionError naming `what` if none comes within timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
