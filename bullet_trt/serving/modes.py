"""The engine for a serving mode: `chunked` (one session, hybrid batches) or the spatial
modes `bullet` and `static` (prefill and decode workers on SM partitions)."""
from __future__ import annotations

import sys

from bullet_trt.config import EngineConfig
from bullet_trt.engine.core import EngineCore
from bullet_trt.serving.calibrate_on_start import ensure_calibrated
from bullet_trt.serving.device_sizing import report, size_for_device
from bullet_trt.spatial.orchestrator import SpatialEngine


# Under this TPOT SLO auto serves chunked even where bullet's workers could share the GPU: at
# 25 ms bullet's decode, planned to the SLO on its own SMs, left prefill too few of them and it
# sustained less than chunked launched one ahead on an H100 and on an H200; at 40 and 50 ms the
# two matched on the H100 and bullet led by at most 1.09-1.14x on the H200 (docs/benchmarks.md,
# eighteenth round). Between 25 and 40 ms nothing was measured.
AUTO_BULLET_MIN_TPOT_SLO_MS = 40.0


def resolve_mode(cfg: EngineConfig) -> str:
    """serve.mode=auto: bullet where its workers can share the GPU (an MPS daemon answers;
    without one two processes only time-slice it) and the TPOT SLO leaves its split room,
    chunked elsewhere."""
    if cfg.serve.mode != "auto":
        return cfg.serve.mode
    if cfg.resolve_device() == "cpu":
        return "chunked"
    if cfg.serve.tpot_slo_ms < AUTO_BULLET_MIN_TPOT_SLO_MS:
        print(f"bullet_trt: serve.mode=auto runs chunked: serve.tpot_slo_ms={cfg.serve.tpot_slo_ms:g} is "
              f"under {AUTO_BULLET_MIN_TPOT_SLO_MS:g} ms, where bullet's split served less than chunked "
              "(--set serve.mode=bullet to run it anyway)", file=sys.stderr, flush=True)
        return "chunked"
    from bullet_trt.spatial.partitioners.mps_daemon import mps_daemon_running

    if mps_daemon_running():
        return "bullet"
    print("bullet_trt: serve.mode=auto runs chunked: no MPS daemon answers (start one with "
          "scripts/start_mps.sh or `bullet-trt serve --mps on` for bullet)", file=sys.stderr, flush=True)
    return "chunked"


def create_engine(cfg: EngineConfig) -> EngineCore | SpatialEngine:
    cfg.serve.mode = resolve_mode(cfg)
    if cfg.serve.mode == "chunked":
        return EngineCore(cfg)
    return SpatialEngine(cfg)


def create_served_engine(cfg: EngineConfig) -> EngineCore | SpatialEngine:
    """The engine behind a server: its GPU calibrated if it was not (serve.calibrate), sized
    for that GPU and mode (serve.sizing), then built."""
    cfg.serve.mode = resolve_mode(cfg)
    ensure_calibrated(cfg)
    report(size_for_device(cfg))
    return create_engine(cfg)
