"""No partitioning: CPU runs, single-phase runs, and GPUs where nothing else works.

stream() is None, which callers treat as "use the current stream"
(`torch.cuda.stream(None)` is a no-op context manager).
"""
from __future__ import annotations

from typing import Any

from bullet_trt.spatial.partitioners.base import Partitioner


class NonePartitioner(Partitioner):
    name = "none"
    granularity = 1

    def __init__(self, device="cpu", total_sms: int | None = None) -> None:
        super().__init__()
        self.device = str(device)
        if total_sms is None:
            total_sms = 0
            if self.device.split(":")[0] == "cuda":
                import torch

                total_sms = torch.cuda.get_device_properties(torch.device(self.device)).multi_processor_count
        self.total_sms = int(total_sms)

    def splits(self) -> list[int]:
        return []

    def prepare(self, role: str, splits: list[int] | None = None) -> None:
        self.role = self.check_role(role)
        self.prepared = []  # nothing to split: every split is the whole device

    def stream(self, prefill_sms: int | None):
        return None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["device"] = self.device
        d["note"] = "no SM partitioning: each role runs on the whole device (current stream)"
        return d
