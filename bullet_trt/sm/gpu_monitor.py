"""GPU utilization samples for the iteration records, through NVML (nvidia-ml-py).

NVML averages SM and memory-controller activity over its own sampling window, so a sample
is taken at most every `min_interval_s` and reused in between; where NVML or the driver does
not expose the counters (CPU runs, some virtual machines) the sample is empty.
"""
from __future__ import annotations

import time


class GpuMonitor:
    def __init__(self, device_index: int | None, min_interval_s: float = 0.2):
        self.handle = None
        self.min_interval_s = min_interval_s
        self._last: dict = {}
        self._last_time = 0.0
        if device_index is None:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: records simply carry no utilization
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        now = time.monotonic()
        if now - self._last_time >= self.min_interval_s:
            try:
                u = self._nvml.nvmlDeviceGetUtilizationRates(self.handle)
                self._last = {"gpu_sm_util_pct": int(u.gpu), "gpu_mem_util_pct": int(u.memory)}
            except Exception:  # noqa: BLE001
                self._last = {}
            self._last_time = now
        return self._last
