"""Reports serving-loop iterations that take longer than a threshold, with where the time went.

Set BULLET_TRT_STALL_MS (e.g. 200) in the server's environment. A loop that uses it brackets
each iteration with `begin()` / `end(**parts)`; an iteration over the threshold is written to
stderr (the server log) as one line with its parts (milliseconds, counts) and the cyclic
garbage collections that ran during it. An iteration still running at three times the
threshold also gets every thread's stack dumped (faulthandler), which shows where a stall
sits while it lasts. Unset, `from_env()` returns None and nothing is measured.
"""
from __future__ import annotations

import faulthandler
import gc
import math
import os
import sys
import time


class StallWatch:
    def __init__(self, where: str, threshold_ms: float):
        self.where = where
        self.threshold_ms = threshold_ms
        self._start = 0.0
        self._gc_ms: list[float] = []
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, where: str) -> "StallWatch | None":
        value = os.environ.get("BULLET_TRT_STALL_MS", "")
        try:
            threshold = float(value)
        except ValueError:
            return None
        return cls(where, threshold) if math.isfinite(threshold) and threshold > 0 else None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_ms.append((time.perf_counter() - self._gc_started) * 1e3)

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._gc_ms.clear()
        faulthandler.dump_traceback_later(3 * self.threshold_ms / 1e3, file=sys.__stderr__)

    def close(self) -> None:
        """Disarms the stack dump of an iteration that will not end (the loop is leaving)."""
        faulthandler.cancel_dump_traceback_later()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def end(self, **parts) -> None:
        faulthandler.cancel_dump_traceback_later()
        ms = (time.perf_counter() - self._start) * 1e3
        if ms < self.threshold_ms:
            return
        detail = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in parts.items())
        gcs = [round(g, 1) for g in self._gc_ms if g >= 1.0]
        print(f"[stall] {self.where} pid {os.getpid()} t={time.time():.3f} iteration {ms:.1f} ms "
              f"{detail} gc_ms={gcs}", file=sys.stderr, flush=True)
