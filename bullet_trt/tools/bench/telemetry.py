"""GPU telemetry (SM clock, power, utilization through NVML) sampled during a benchmark run:
which GPU, and what of it goes into the run's JSON."""
from __future__ import annotations

from bullet_trt.spatial.gpu_monitor import TelemetrySampler, summarize_telemetry


def telemetry_device(args, url: str) -> int | None:
    """Which GPU to sample during the runs: --gpu-telemetry's index, or with ``auto`` device 0
    when the server is on this host (its GPU is then visible here); None for ``off``."""
    choice = str(getattr(args, "gpu_telemetry", "off")).strip().lower()
    if choice == "off":
        return None
    if choice == "auto":
        host = url.rsplit(":", 1)[0].strip("[]").lower()
        return 0 if host in ("localhost", "127.0.0.1", "::1") else None
    try:
        return int(choice)
    except ValueError:
        raise SystemExit(f"--gpu-telemetry must be auto, off or a GPU index, got {choice!r}") from None


def telemetry_fields(sampler: TelemetrySampler, arrivals_s: float | None) -> dict:
    """The result JSON's ``gpu_telemetry`` (summarized over the arrival window), or nothing
    when the sampler had no GPU."""
    if not sampler.available:
        return {}
    return {"gpu_telemetry": {"device_index": sampler.device_index, "interval_s": sampler.interval_s,
                              "summary": summarize_telemetry(sampler.samples, arrivals_s),
                              "samples": sampler.samples}}
