"""serve.partitioner -> a Partitioner: the one module that knows every implementation."""
from __future__ import annotations

import os

from bullet_trt.spatial.partitioners.base import KINDS, SETTING, Partitioner
from bullet_trt.spatial.partitioners.green import GreenPartitioner, green_available
from bullet_trt.spatial.partitioners.libsmctrl import LibsmctrlPartitioner
from bullet_trt.spatial.partitioners.mps import MpsPartitioner
from bullet_trt.spatial.partitioners.none import NonePartitioner


def _is_cpu(device) -> bool:
    return str(device).split(":")[0] == "cpu"


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
        return NonePartitioner(device, total_sms=total_sms)
    if cpu:
        raise RuntimeError(f"{SETTING}={kind} needs a CUDA device, but the device is {device!r}; "
                           f"use {SETTING}=none (or auto) on CPU")
    if kind == "green":
        return GreenPartitioner(device, require_mps=require_mps)
    if kind == "mps":
        return MpsPartitioner(device, prefill_sms=prefill_sms, total_sms=total_sms,
                              require_mps=require_mps)
    path = libsmctrl_path or os.environ.get("LIBSMCTRL_PATH", "")
    return LibsmctrlPartitioner(device, path, require_mps=require_mps, total_sms=total_sms)
