"""libsmctrl partitioner (optional; what the Bullet paper used).

libsmctrl sets a per-stream TPC mask inside the CUDA driver's stream struct. It is
NOT shipped with this project (it carries no license): the user builds it and points
us at it with serve.libsmctrl_path (or env LIBSMCTRL_PATH); native/libbullet_smctrl.so
dlopens it at run time. Its struct offsets are known only for CUDA 12.0-12.8 drivers,
so any other driver (e.g. 580 / CUDA 13.0) is refused before libsmctrl is called.

Per split with s prefill SMs (2 SMs per TPC on Hopper): the prefill role's stream is
enabled on TPCs [0, s/2), the decode role's on TPCs [s/2, total). Unlike green
contexts, each role's two-process sets are disjoint by construction (same TPC ids),
and masks apply per launch, so CUDA graphs are not bound to them the same way.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from bullet_trt.spatial.partitioners import native
from bullet_trt.spatial.partitioners.base import SETTING, Partitioner, device_index
from bullet_trt.spatial.partitioners.cuda_driver import check
from bullet_trt.spatial.partitioners.mps_daemon import require_mps_client

PATH_SETTING = "serve.libsmctrl_path"
SMS_PER_TPC = 2  # Volta through Hopper
MIN_DRIVER, MAX_DRIVER = 12000, 12080


def _fmt(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


class LibsmctrlPartitioner(Partitioner):
    name = "libsmctrl"
    granularity = SMS_PER_TPC

    def __init__(self, device="cuda", path: str = "", require_mps: bool = False,
                 total_sms: int | None = None) -> None:
        super().__init__()
        if not path:
            raise ValueError(f"{SETTING}=libsmctrl needs {PATH_SETTING} (or env LIBSMCTRL_PATH): the path "
                             "of your libsmctrl.so build (libsmctrl is not shipped with bullet_trt)")
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"{PATH_SETTING}={path!r}: no such file (build libsmctrl and point "
                             f"{PATH_SETTING} or LIBSMCTRL_PATH at its shared library)")
        try:
            shim = native.smctrl_lib()
        except native.NativeLibraryMissing as e:
            raise RuntimeError(f"{SETTING}=libsmctrl: {e}") from e
        err = ctypes.create_string_buffer(512)
        rc = shim.bullet_smctrl_open(str(p).encode(), err, len(err))
        if rc == -3:
            raise RuntimeError(
                f"{SETTING}=libsmctrl: {err.value.decode()}; libsmctrl finds stream masks through driver "
                f"struct offsets known only for CUDA {_fmt(MIN_DRIVER)}-{_fmt(MAX_DRIVER)} drivers. "
                f"Use {SETTING}=green on this driver")
        if rc != 0:
            raise RuntimeError(f"{PATH_SETTING}={path!r}: libsmctrl does not load: {err.value.decode()}")
        self.path = str(p)
        self.shim = shim
        self.index = device_index(device)
        self.require_mps = require_mps
        self.driver_version = shim.bullet_smctrl_driver_version()
        if total_sms is None:
            import torch

            total_sms = torch.cuda.get_device_properties(self.index).multi_processor_count
        self.total_sms = int(total_sms)
        self.total_tpcs = self.total_sms // SMS_PER_TPC
        if self.total_tpcs > 128:
            raise RuntimeError(f"{SETTING}=libsmctrl: {self.total_tpcs} TPCs; masks cover at most 128")
        if self.total_tpcs > 64 and not shim.bullet_smctrl_has_ext():
            raise RuntimeError(f"{PATH_SETTING}={path!r}: this GPU has {self.total_tpcs} TPCs but the library "
                               "lacks libsmctrl_set_stream_mask_ext (needed above 64 TPCs): update libsmctrl")
        self._streams: dict[int, Any] = {}
        self._handles: list[Any] = []
        self._full = None

    def tpc_range(self, role: str, prefill_sms: int) -> tuple[int, int]:
        """(first TPC, number of TPCs) enabled for `role` at this split."""
        k = prefill_sms // SMS_PER_TPC
        return (0, k) if role == "prefill" else (k, self.total_tpcs - k)

    def _new_stream(self):
        """A stream of its own (torch's pool recycles 32 streams, which would share masks)."""
        import torch
        from cuda.bindings import runtime as rt

        check(rt.cudaSetDevice(self.index), "cudaSetDevice")
        handle = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self._handles.append(handle)
        return torch.cuda.get_stream_from_external(int(handle), device=torch.device("cuda", self.index))

    def prepare(self, role: str, splits: list[int] | None = None) -> None:
        import torch

        role = self.check_role(role)
        wanted = self.validate_splits(self.splits() if splits is None else splits)
        if self.require_mps:
            require_mps_client(role, self.index, f"{SETTING}=libsmctrl")
        self.role = role
        torch.cuda.init()
        for s in wanted:
            if s in self._streams:
                continue
            stream = self._new_stream()
            first, num = self.tpc_range(role, s)
            rc = self.shim.bullet_smctrl_set_tpc_range(ctypes.c_void_p(stream.cuda_stream), first, num,
                                                       self.total_tpcs)
            if rc != 0:
                raise RuntimeError(f"libsmctrl mask for {role} split {s} (TPCs {first}..{first + num - 1}) "
                                   f"failed: {native.SMCTRL_ERRORS.get(rc, rc)}")
            self._streams[s] = stream
        if self._full is None:
            self._full = self._new_stream()
        self.prepared = sorted(self._streams)

    def stream(self, prefill_sms: int | None):
        if self.role is None:
            raise RuntimeError("LibsmctrlPartitioner.stream() before prepare()")
        if self.is_full(prefill_sms):
            return self._full
        try:
            return self._streams[prefill_sms]
        except KeyError:
            raise ValueError(f"prefill split {prefill_sms} SMs was not prepared; prepared: "
                             f"{self.prepared}") from None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(device=f"cuda:{self.index}", path=self.path, driver=_fmt(self.driver_version),
                 total_tpcs=self.total_tpcs,
                 splits=[{"requested": s, "prefill_sms": s, "decode_sms": self.total_sms - s,
                          "tpcs": list(self.tpc_range(self.role or "prefill", s))} for s in self.prepared])
        return d


def libsmctrl_path_from_env() -> str:
    return os.environ.get("LIBSMCTRL_PATH", "")
