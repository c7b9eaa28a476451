"""The partitioner interface and the names every partitioner shares.

Nothing here imports an implementation: factory.py builds them, and they all import this.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

ROLES = ("prefill", "decode")
SETTING = "serve.partitioner"
KINDS = ("auto", "green", "libsmctrl", "mps", "none")


class Partitioner(ABC):
    """Splits a GPU's SMs between a prefill role and a decode role."""

    name: str = "?"
    total_sms: int = 0
    granularity: int = 8

    def __init__(self) -> None:
        self.role: str | None = None
        self.prepared: list[int] = []

    # -- splits -----------------------------------------------------------------
    def splits(self) -> list[int]:
        """Prefill SM counts this partitioner offers: granularity .. total - granularity."""
        g, n = self.granularity, self.total_sms
        return list(range(g, n - g + 1, g)) if n > 2 * g - 1 else []

    def validate_splits(self, splits: list[int], setting: str = SETTING) -> list[int]:
        """Sorted, de-duplicated splits; ValueError naming `setting` for a bad one."""
        out = sorted({int(s) for s in splits})
        for s in out:
            if s <= 0 or s >= self.total_sms:
                raise ValueError(
                    f"{setting}: prefill SM count {s} must be > 0 and < the GPU's {self.total_sms} SMs "
                    f"(decode needs the rest); {self.name} offers {self._offer()}")
            if s % self.granularity:
                raise ValueError(
                    f"{setting}: prefill SM count {s} is not a multiple of {self.granularity}, the "
                    f"{self.name} partitioner's SM step; {self.name} offers {self._offer()}")
        return out

    def _offer(self) -> str:
        s = self.splits()
        return f"{s[0]}..{s[-1]} step {self.granularity}" if len(s) > 1 else str(s)

    @staticmethod
    def check_role(role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"partitioner role must be 'prefill' or 'decode', got {role!r}")
        return role

    def is_full(self, prefill_sms: int | None) -> bool:
        """True when the role alone gets the whole GPU (no split)."""
        return prefill_sms is None or prefill_sms <= 0 or prefill_sms >= self.total_sms

    # -- life cycle ---------------------------------------------------------------
    @abstractmethod
    def prepare(self, role: str, splits: list[int] | None = None) -> None:
        """Creates every stream `role` will need for `splits` (default: all of splits())."""

    @abstractmethod
    def stream(self, prefill_sms: int | None):
        """The torch.cuda.Stream (or None on CPU) for this role at this split."""

    def worker_env(self, role: str, prefill_sms: int | None = None) -> dict[str, str]:
        """Environment the spawner must give the worker before CUDA initializes."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "total_sms": self.total_sms, "granularity": self.granularity,
                "role": self.role, "prepared": list(self.prepared)}

    def close(self) -> None:
        """Releases streams/contexts (optional; the process exit does it too)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(total_sms={self.total_sms}, role={self.role!r})"


def device_index(device) -> int:
    """CUDA ordinal of `device` ("cuda", "cuda:1", torch.device, int)."""
    if isinstance(device, int):
        return device
    import torch  # noqa: PLC0415 - keep bullet_trt.spatial.partitioners light to import

    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0
