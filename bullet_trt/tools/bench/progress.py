"""The status line a benchmark run prints while its requests are in flight."""
from __future__ import annotations

import sys


class ProgressPrinter:
    """One status line, rewritten in place on a terminal, every few seconds otherwise (a log
    file would otherwise fill with carriage returns)."""

    def __init__(self, prefix: str, stream=None, enabled: bool = True, interval_s: float = 5.0):
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = interval_s
        self._last = -1e9
        self._width = 0

    def __call__(self, p) -> None:
        if not self.enabled:
            return
        ttft = f"{p.p50_ttft_s * 1e3:.0f} ms" if p.p50_ttft_s is not None else "-"
        line = (f"{self.prefix} {p.elapsed_s:6.1f}s  sent {p.sent}/{p.total}  finished {p.finished}"
                f"  failed {p.failed}  in flight {p.in_flight}  p50 TTFT {ttft}")
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()
        elif p.elapsed_s - self._last >= self.interval_s or p.finished + p.failed == p.total:
            self._last = p.elapsed_s
            self.stream.write(line + "\n")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
