"""MpsPartitioner: the static split by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.

The fallback where green contexts are unavailable. The percentage is read by the driver
when CUDA initializes in the worker, so the spawner must put worker_env(...) into the
worker's environment (mps_daemon.worker_env builds it). A percentage caps how many SMs a
client may use at once; it does not say WHICH SMs, so the two roles' SM sets may overlap
(green contexts are disjoint).
"""
from __future__ import annotations

import os
from typing import Any

from bullet_trt.spatial.partitioners.base import SETTING, Partitioner, device_index
from bullet_trt.spatial.partitioners.mps_daemon import (
    ENV_PCT,
    ENV_PREFILL,
    ENV_TOTAL,
    mps_percentages,
    require_mps_client,
    worker_env,
)

MPS_GRANULARITY = 2  # one TPC on Hopper


def _device_sms(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)


class MpsPartitioner(Partitioner):
    """Static split by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; stream() is the default stream."""

    name = "mps"
    granularity = MPS_GRANULARITY

    def __init__(self, device="cuda", prefill_sms: int | None = None, total_sms: int | None = None,
                 require_mps: bool = False) -> None:
        super().__init__()
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{SETTING}=mps needs a CUDA GPU, but torch.cuda.is_available() is False")
        self.index = device_index(device)
        self.require_mps = require_mps
        # In a worker, the spawner's worker_env() carries the true total and the split:
        # under a percentage the device reports only the capped SM count.
        if total_sms is None and os.environ.get(ENV_TOTAL):
            total_sms = int(os.environ[ENV_TOTAL])
        self.reported_sms = _device_sms(self.index)
        self.total_sms = int(total_sms or self.reported_sms)
        if not prefill_sms and os.environ.get(ENV_PREFILL, "0") not in ("", "0"):
            prefill_sms = int(os.environ[ENV_PREFILL])
        if not prefill_sms:
            prefill_sms = max(8, self.total_sms // 2 // 8 * 8)
        self.prefill_sms = self.validate_splits([prefill_sms], "serve.static_prefill_sms")[0]

    def splits(self) -> list[int]:
        return [self.prefill_sms] if getattr(self, "prefill_sms", None) else super().splits()

    def worker_env(self, role: str, prefill_sms: int | None = None) -> dict[str, str]:
        return worker_env(role, self.prefill_sms if prefill_sms is None else prefill_sms, self.total_sms)

    def prepare(self, role: str, splits: list[int] | None = None) -> None:
        import torch

        role = self.check_role(role)
        for s in splits or []:
            if s != self.prefill_sms and not self.is_full(s):
                raise ValueError(
                    f"{SETTING}=mps is a static split (serve.static_prefill_sms={self.prefill_sms}); "
                    f"split {s} cannot be served: use {SETTING}=green for per-iteration splits")
        want = worker_env(role, self.prefill_sms, self.total_sms)[ENV_PCT]
        have = os.environ.get(ENV_PCT)
        if have != want:
            raise RuntimeError(
                f"{SETTING}=mps: the {role} worker runs with {ENV_PCT}={have!r}, expected {want!r}; "
                "the spawner must put MpsPartitioner.worker_env(role) into the worker's environment "
                "before CUDA initializes")
        if self.require_mps:
            require_mps_client(role, self.index, f"{SETTING}=mps")
        self.role = role
        self._stream = torch.cuda.default_stream(torch.device("cuda", self.index))
        self.prepared = [self.prefill_sms]

    def stream(self, prefill_sms: int | None):
        if self.role is None:
            raise RuntimeError("MpsPartitioner.stream() before prepare()")
        if prefill_sms != self.prefill_sms and not self.is_full(prefill_sms):
            raise ValueError(f"{SETTING}=mps serves only its static split {self.prefill_sms}, "
                             f"not {prefill_sms}")
        return self._stream

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        pf, dc = mps_percentages(self.prefill_sms, self.total_sms)
        d.update(device=f"cuda:{self.index}", prefill_sms=self.prefill_sms,
                 decode_sms=self.total_sms - self.prefill_sms,
                 percentages={"prefill": pf, "decode": dc},
                 env_percentage=os.environ.get(ENV_PCT), reported_sms=self.reported_sms,
                 note="percentages cap SM counts; the two roles' SM sets may overlap")
        return d
