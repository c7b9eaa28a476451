"""SM partitioners: give prefill and decode each their own share of the GPU's SMs.

One interface, four implementations (bullet_trt/sm/{green,libsmctrl,mps,none}.py):

    part = make_partitioner(cfg.serve.partitioner, device)   # in the worker process
    part.prepare("decode", part.splits())                     # once, at start-up
    ...
    with torch.cuda.stream(part.stream(prefill_sms)):        # every iteration
        run_decode_step()

`stream(prefill_sms)` returns the stream this role's work must run on while prefill
holds `prefill_sms` SMs and decode the rest. All streams are created in `prepare`;
`stream()` is a dictionary lookup. Work queued on different streams is not ordered:
when a role moves from one split's stream to another's, make the new stream wait for
the old one (`new.wait_stream(old)`) or for an event recorded on it. CUDA graphs are
bound to the SM set of the stream they were captured on (docs/partitioning.md), so
capture decode graphs once per split, each on that split's stream.
"""
from __future__ import annotations

import os
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


def _is_cpu(device) -> bool:
    return str(device).split(":")[0] == "cpu"


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


def green_available(device="cuda") -> tuple[bool, str]:
    """(True, "") when green contexts can be created on `device`, else (False, why)."""
    from bullet_trt.spatial.partitioners import green

    return green.green_available(device)


def make_partitioner(kind: str, device="cuda", *, prefill_sms: int | None = None,
                     libsmctrl_path: str | None = None, require_mps: bool = False,
                     total_sms: int | None = None) -> Partitioner:
    """Builds the partitioner named by serve.partitioner.

    kind: auto | green | libsmctrl | mps | none. auto is none on CPU, green where green
    contexts work, else mps. prefill_sms is the static split (serve.static_prefill_sms)
    for mps; libsmctrl_path (serve.libsmctrl_path, else env LIBSMCTRL_PATH) for libsmctrl.
    require_mps makes prepare() refuse to run outside an MPS client (two worker
    processes without MPS only time-slice).
    """
    kind = (kind or "auto").strip().lower()
    if kind not in KINDS:
        raise ValueError(f"{SETTING} must be one of {', '.join(KINDS)}, got {kind!r}")
    cpu = _is_cpu(device)
    if kind == "auto":
        if cpu:
            kind = "none"
        else:
            ok, _ = green_available(device)
            kind = "green" if ok else "mps"
    if kind == "none":
        from bullet_trt.spatial.partitioners.none import NonePartitioner

        return NonePartitioner(device, total_sms=total_sms)
    if cpu:
        raise RuntimeError(f"{SETTING}={kind} needs a CUDA device, but the device is {device!r}; "
                           f"use {SETTING}=none (or auto) on CPU")
    if kind == "green":
        from bullet_trt.spatial.partitioners.green import GreenPartitioner

        return GreenPartitioner(device, require_mps=require_mps)
    if kind == "mps":
        from bullet_trt.spatial.partitioners.mps import MpsPartitioner

        return MpsPartitioner(device, prefill_sms=prefill_sms, total_sms=total_sms,
                              require_mps=require_mps)
    from bullet_trt.spatial.partitioners.libsmctrl import LibsmctrlPartitioner

    path = libsmctrl_path or os.environ.get("LIBSMCTRL_PATH", "")
    return LibsmctrlPartitioner(device, path, require_mps=require_mps, total_sms=total_sms)
