"""GPU samples through NVML (nvidia-ml-py): utilization, SM clock, power and energy.

Two users: the orchestrator's iteration records (`GpuMonitor.sample`, one sample per
iteration, reused within `min_interval_s`), and the serving benchmark (`TelemetrySampler`, a
thread sampling at a fixed interval over a run). The clock and the power say whether the chip
ran at its power limit: when both partitions run GEMMs, the chip throttles its clock, and a
phase loses speed that no SM split gives back.

NVML averages SM and memory-controller activity over its own sampling window. Where NVML or
the driver does not expose a counter (CPU runs, some virtual machines) the sample lacks it.
"""
from __future__ import annotations

import os
import statistics
import threading
import time


def nvml_device(cuda_index: int, visible: str | None = None) -> int | str:
    """What NVML calls CUDA device ``cuda_index`` of this process: NVML counts every GPU of the
    host and ignores CUDA_VISIBLE_DEVICES, so a server started with CUDA_VISIBLE_DEVICES=1 (one
    of two runs side by side) would otherwise read the clock and power of the other run's GPU.
    An int is an NVML index, a str a UUID ("GPU-..." or "MIG-...")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    if not visible.strip():
        return cuda_index
    entries = [e.strip() for e in visible.split(",")]
    if cuda_index >= len(entries):
        raise ValueError(f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


def nvml_handle(nvml, cuda_index: int):
    """NVML's handle of CUDA device ``cuda_index`` (after nvmlInit)."""
    device = nvml_device(cuda_index)
    if isinstance(device, int):
        return nvml.nvmlDeviceGetHandleByIndex(device)
    return nvml.nvmlDeviceGetHandleByUUID(device)


def _open(device_index: int | None):
    """(pynvml, handle), or (None, None) without NVML or without that device."""
    if device_index is None:
        return None, None
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml, nvml_handle(pynvml, device_index)
    except Exception:  # noqa: BLE001 - no NVML: samples are simply empty
        return None, None


def read_sample(nvml, handle) -> dict:
    """One reading; each counter the driver refuses is left out."""
    out: dict = {}
    try:
        u = nvml.nvmlDeviceGetUtilizationRates(handle)
        out["gpu_sm_util_pct"], out["gpu_mem_util_pct"] = int(u.gpu), int(u.memory)
    except Exception:  # noqa: BLE001
        pass
    try:
        out["sm_clock_mhz"] = int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001
        pass
    try:
        out["power_w"] = round(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, 1)
    except Exception:  # noqa: BLE001
        pass
    try:  # millijoules since the driver loaded (Volta and later): a run's energy without sampling gaps
        out["energy_j"] = round(nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0, 3)
    except Exception:  # noqa: BLE001
        pass
    try:
        # Older nvidia-ml-py names these "throttle" reasons; the bits are the same.
        get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = int(get(handle))
        cap = (getattr(nvml, "nvmlClocksEventReasonSwPowerCap", 0x4)
               | getattr(nvml, "nvmlClocksEventReasonHwPowerBrakeSlowdown", 0x80))
        out["power_capped"] = bool(reasons & cap)
    except Exception:  # noqa: BLE001
        pass
    return out


class GpuMonitor:
    def __init__(self, device_index: int | None, min_interval_s: float = 0.2):
        self._nvml, self.handle = _open(device_index)
        self.min_interval_s = min_interval_s
        self._last: dict = {}
        self._last_time = 0.0

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        now = time.monotonic()
        if now - self._last_time >= self.min_interval_s:
            self._last = read_sample(self._nvml, self.handle)
            self._last_time = now
        return self._last


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p10": values[0], "p50": values[0], "p90": values[0]}
    q = statistics.quantiles(values, n=10, method="inclusive")
    return {"p10": round(q[0], 1), "p50": round(statistics.median(values), 1), "p90": round(q[8], 1)}


def summarize_telemetry(samples: list[dict], until_s: float | None = None) -> dict:
    """Spreads of clock, power and utilization over the samples taken up to ``until_s`` (the
    run's arrival window: the drain that follows runs a shrinking batch), and the share of them
    taken while the driver reported a power cap."""
    window = [s for s in samples if until_s is None or s["t"] <= until_s]
    out: dict = {"samples": len(window)}
    for key in ("sm_clock_mhz", "power_w", "gpu_sm_util_pct", "gpu_mem_util_pct"):
        out[key] = _spread([s[key] for s in window if key in s])
    capped = [s["power_capped"] for s in window if "power_capped" in s]
    out["power_capped_fraction"] = round(sum(capped) / len(capped), 3) if capped else None
    return out


class TelemetrySampler:
    """Samples one GPU every ``interval_s`` on a thread between start() and stop(); each sample
    carries ``t``, seconds since start(). Without NVML it records nothing."""

    def __init__(self, device_index: int | None, interval_s: float = 0.25):
        self._nvml, self.handle = _open(device_index)
        self.device_index = device_index
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def start(self) -> "TelemetrySampler":
        if self.handle is None:
            return self
        t0 = time.monotonic()

        def loop():
            while not self._stop.is_set():
                self.samples.append({"t": round(time.monotonic() - t0, 3), **read_sample(self._nvml, self.handle)})
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.samples
