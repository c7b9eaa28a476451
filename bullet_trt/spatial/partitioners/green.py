"""Green-context partitioner (CUDA >= 12.4 driver, cuda.bindings).

For every prefill SM count s, ONE `cuDevSmResourceSplitByCount(1, device_sms, 0, s)`
call yields a group of >= s SMs and the remainder. The prefill role builds its green
context on the group, the decode role on the remainder. Within one split the two are
disjoint; the split is deterministic, so the prefill process's group and the decode
process's remainder are disjoint too (measured under MPS: docs/partitioning.md,
"Measured: group and remainder in two MPS clients").
Two groups from two separate calls are the SAME SMs: never pair group with group.

Each split gets one green context and one stream (cuGreenCtxStreamCreate), wrapped for
torch with torch.cuda.get_stream_from_external. The context objects are kept alive for
the life of the partitioner: streams of a destroyed context fail.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from bullet_trt.spatial.partitioners import cuda_driver
from bullet_trt.spatial.partitioners.base import SETTING, Partitioner, device_index
from bullet_trt.spatial.partitioners.cuda_driver import check, device_sm_resource, driver_version
from bullet_trt.spatial.partitioners.mps_daemon import ENV_PCT, require_mps_client

MIN_DRIVER = 12040  # green contexts need a CUDA 12.4 driver
_AVAILABLE: dict[int, tuple[bool, str]] = {}


def split_once(res, prefill_sms: int):
    """ONE split call: (group, remainder) resources for `prefill_sms`."""
    drv = cuda_driver.driver()
    groups, nb, remainder = check(drv.cuDevSmResourceSplitByCount(1, res, 0, int(prefill_sms)),
                                  f"cuDevSmResourceSplitByCount(minCount={prefill_sms})")
    if int(nb) < 1:
        raise RuntimeError(f"cuDevSmResourceSplitByCount(minCount={prefill_sms}) made no group "
                           f"out of {res.sm.smCount} SMs")
    return groups[0], remainder


def create_green_stream(dev, resource, what: str):
    """(green ctx, CUstream) on `resource`; the caller keeps both alive."""
    drv = cuda_driver.driver()
    desc = check(drv.cuDevResourceGenerateDesc([resource], 1), f"cuDevResourceGenerateDesc({what})")
    ctx = check(drv.cuGreenCtxCreate(desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                f"cuGreenCtxCreate({what})")
    try:
        stream = check(drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                       f"cuGreenCtxStreamCreate({what})")
    except Exception:
        drv.cuGreenCtxDestroy(ctx)
        raise
    return ctx, stream


def sm_granularity(res) -> int:
    """SM step of green-context groups: 8 on Hopper (asking 66 gives 72), or the driver's
    minimum partition size / co-scheduling alignment where that is coarser."""
    sm = res.sm
    return max(8, int(getattr(sm, "minSmPartitionSize", 0) or 0), int(getattr(sm, "smCoscheduledAlignment", 0) or 0))


def green_available(device="cuda") -> tuple[bool, str]:
    """(True, "") when green contexts work on `device`, else (False, reason). Cached."""
    try:
        index = device_index(device)
    except Exception as e:  # noqa: BLE001
        return False, str(e)
    if index in _AVAILABLE:
        return _AVAILABLE[index]
    try:
        cuda_driver.driver()
    except ImportError as e:
        out = (False, f"cuda.bindings (cuda-python) is not installed: {e}")
    else:
        try:
            version = driver_version()
            if version < MIN_DRIVER:
                out = (False, f"driver CUDA version {version // 1000}.{version % 1000 // 10} < 12.4")
            else:
                dev, res = device_sm_resource(index)
                group, rem = split_once(res, sm_granularity(res))
                ctx, stream = create_green_stream(dev, group, "availability probe")
                drv = cuda_driver.driver()
                check(drv.cuStreamDestroy(stream), "cuStreamDestroy")
                check(drv.cuGreenCtxDestroy(ctx), "cuGreenCtxDestroy")
                out = (True, "")
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            out = (False, f"{type(e).__name__}: {e}")
    _AVAILABLE[index] = out
    return out


@dataclass
class GreenSplit:
    requested: int          # prefill SM count asked for
    prefill_sms: int        # SMs the group actually got
    decode_sms: int         # SMs of the remainder
    ctx: Any                # CUgreenCtx: must outlive the stream
    cu_stream: Any          # CUstream
    stream: Any             # torch.cuda.Stream wrapping cu_stream


class GreenPartitioner(Partitioner):
    name = "green"

    def __init__(self, device="cuda", require_mps: bool = False) -> None:
        super().__init__()
        if os.environ.get(ENV_PCT):
            raise RuntimeError(
                f"{SETTING}=green: {ENV_PCT}={os.environ[ENV_PCT]} is set and caps green contexts; "
                "unset it in the worker environment (green contexts do the split)")
        ok, why = green_available(device)
        if not ok:
            raise RuntimeError(
                f"{SETTING}=green: green contexts are unavailable on {device!r}: {why}. "
                f"Use {SETTING}=mps (static split) or {SETTING}=none")
        self.index = device_index(device)
        self.require_mps = require_mps
        self._dev, self._res = device_sm_resource(self.index)
        self.total_sms = int(self._res.sm.smCount)
        self.granularity = sm_granularity(self._res)
        self._splits: dict[int, GreenSplit] = {}
        self._full = None
        self.create_ms = 0.0

    def prepare(self, role: str, splits: list[int] | None = None) -> None:
        import torch

        role = self.check_role(role)
        wanted = self.validate_splits(self.splits() if splits is None else splits)
        if self.role is not None and self.role != role:
            raise RuntimeError(f"green partitioner already prepared for {self.role!r}, not {role!r}")
        if self.require_mps:
            require_mps_client(role, self.index)
        self.role = role
        device = torch.device("cuda", self.index)
        torch.cuda.init()
        t0 = time.perf_counter()
        for s in wanted:
            if s in self._splits:
                continue
            group, remainder = split_once(self._res, s)
            mine = group if role == "prefill" else remainder
            what = f"{role} of split {s}"
            ctx, cu_stream = create_green_stream(self._dev, mine, what)
            stream = torch.cuda.get_stream_from_external(int(cu_stream), device=device)
            self._splits[s] = GreenSplit(s, int(group.sm.smCount), int(remainder.sm.smCount),
                                         ctx, cu_stream, stream)
        if self._full is None:
            self._full = torch.cuda.Stream(device=device)
        self.create_ms += (time.perf_counter() - t0) * 1e3
        self.prepared = sorted(self._splits)

    def stream(self, prefill_sms: int | None):
        if self.role is None:
            raise RuntimeError("GreenPartitioner.stream() before prepare()")
        if self.is_full(prefill_sms):
            return self._full
        try:
            return self._splits[prefill_sms].stream
        except KeyError:
            raise ValueError(f"prefill split {prefill_sms} SMs was not prepared; prepared: "
                             f"{self.prepared}") from None

    def actual_sms(self, prefill_sms: int | None) -> tuple[int, int]:
        """(prefill SMs, decode SMs) the split really has; full device when unsplit."""
        if self.is_full(prefill_sms):
            return self.total_sms, self.total_sms
        sp = self._splits[prefill_sms]
        return sp.prefill_sms, sp.decode_sms

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(device=f"cuda:{self.index}", create_ms=round(self.create_ms, 2),
                 splits=[{"requested": s.requested, "prefill_sms": s.prefill_sms,
                          "decode_sms": s.decode_sms} for s in self._splits.values()])
        return d

    def close(self) -> None:
        """Destroys streams and green contexts; only after all their work is finished."""
        drv = cuda_driver.driver()
        for sp in self._splits.values():
            sp.stream.synchronize()
            check(drv.cuStreamDestroy(sp.cu_stream), "cuStreamDestroy")
            check(drv.cuGreenCtxDestroy(sp.ctx), "cuGreenCtxDestroy")
        self._splits.clear()
        self.prepared = []
