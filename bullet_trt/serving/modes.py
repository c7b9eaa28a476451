"""The engine for a serving mode: `chunked` (one session, hybrid batches) or the spatial
modes `bullet` and `static` (prefill and decode workers on SM partitions)."""
from __future__ import annotations

from bullet_trt.config import EngineConfig
from bullet_trt.engine.core import EngineCore
from bullet_trt.spatial.orchestrator import SpatialEngine


def create_engine(cfg: EngineConfig) -> EngineCore | SpatialEngine:
    if cfg.serve.mode == "chunked":
        return EngineCore(cfg)
    return SpatialEngine(cfg)
