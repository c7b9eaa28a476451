"""Which serving modes a configuration may resolve to, before any engine or GPU context exists
(the CLI decides from it whether a server needs an MPS daemon)."""
from __future__ import annotations

from bullet_trt.config import EngineConfig

# Under this TPOT SLO auto serves chunked even where bullet's workers could share the GPU: at
# 25 ms bullet's decode, planned to the SLO on its own SMs, left prefill too few of them and it
# sustained less than chunked launched one ahead on an H100 and on an H200; at 40 and 50 ms the
# two matched on the H100 and bullet led by at most 1.09-1.14x on the H200 (docs/benchmarks.md,
# eighteenth round). Between 25 and 40 ms nothing was measured.
AUTO_BULLET_MIN_TPOT_SLO_MS = 40.0


def tpot_too_tight_for_split(cfg: EngineConfig) -> bool:
    return cfg.serve.tpot_slo_ms < AUTO_BULLET_MIN_TPOT_SLO_MS


def may_run_spatial(cfg: EngineConfig) -> bool:
    """Whether the server may run a spatial mode (two worker processes sharing the GPU, which
    need MPS): one named, or auto under a TPOT SLO that leaves the split room."""
    if cfg.serve.mode == "chunked":
        return False
    return cfg.serve.mode != "auto" or not tpot_too_tight_for_split(cfg)
