"""The engine for a serving mode: `chunked` (one session, hybrid batches) or the spatial
modes `bullet` and `static` (prefill and decode workers on SM partitions)."""
from __future__ import annotations

import sys

from bullet_trt.config import EngineConfig
from bullet_trt.engine.core import EngineCore
from bullet_trt.serving.calibrate_on_start import ensure_calibrated
from bullet_trt.serving.device_sizing import report, size_for_device
from bullet_trt.serving.mode_choice import AUTO_BULLET_MIN_TPOT_SLO_MS, tpot_too_tight_for_split
from bullet_trt.spatial.orchestrator import SpatialEngine


def resolve_mode(cfg: EngineConfig) -> str:
    """serve.mode=auto: bullet where its workers can share the GPU (an MPS daemon answers;
    without one two processes only time-slice it) and the TPOT SLO leaves its split room,
    chunked elsewhere."""
    if cfg.serve.mode != "auto":
        return cfg.serve.mode
    if cfg.resolve_device() == "cpu":
        return "chunked"
    if tpot_too_tight_for_split(cfg):
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
