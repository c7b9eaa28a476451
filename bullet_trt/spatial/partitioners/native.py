"""ctypes bindings for native/ (built with `make -C native`).

- libbullet_smid.so: the SM-id probe kernel (doctor, GPU tests).
- libbullet_smctrl.so: the run-time shim around a user-supplied libsmctrl.

The libraries are looked up in $BULLET_NATIVE_DIR, else <repo>/native.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

SMID_LIB = "libbullet_smid.so"
SMCTRL_LIB = "libbullet_smctrl.so"
SMID_FIELDS = 7  # per block: smid, start ns, end ns, iterations, max gap ns, gap ns, smid at end
SMID_FIELD_NAMES = ("smid", "start_ns", "end_ns", "iters", "max_gap_ns", "gap_ns", "smid_end")

SMCTRL_ERRORS = {
    -1: "libsmctrl did not load",
    -2: "libsmctrl_set_stream_mask is not exported",
    -3: "driver unsupported by libsmctrl",
    -4: "libsmctrl not opened",
    -5: "TPC range invalid (or more than 128 TPCs)",
    -6: "NULL stream (libsmctrl needs a created stream)",
    -7: "more than 64 TPCs but libsmctrl_set_stream_mask_ext is not exported",
}


class NativeLibraryMissing(RuntimeError):
    """A native/ library is not built (or does not load)."""


def native_dir() -> Path:
    env = os.environ.get("BULLET_NATIVE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "native"


def _load(name: str, what: str) -> ctypes.CDLL:
    path = native_dir() / name
    if not path.is_file():
        raise NativeLibraryMissing(
            f"{path} not found: build it with `make -C native` ({what})")
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeLibraryMissing(f"{path} does not load ({e}): rebuild it with `make -C native`") from e


@lru_cache(maxsize=1)
def smid_lib() -> ctypes.CDLL:
    lib = _load(SMID_LIB, "needs nvcc; the doctor falls back to a Triton probe without it")
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.bullet_smid_fields.restype = i
    lib.bullet_smid_launch.argtypes = [vp, i, i, vp]
    lib.bullet_smid_launch.restype = i
    lib.bullet_smid_probe_ex.argtypes = [vp, i, i, ctypes.POINTER(ctypes.c_ulonglong)]
    lib.bullet_smid_probe_ex.restype = i
    lib.bullet_smid_probe.argtypes = [vp, i, i, ctypes.POINTER(ctypes.c_int)]
    lib.bullet_smid_probe.restype = i
    lib.bullet_smid_error_string.argtypes = [i]
    lib.bullet_smid_error_string.restype = ctypes.c_char_p
    if lib.bullet_smid_fields() != SMID_FIELDS:
        raise NativeLibraryMissing(f"{native_dir() / SMID_LIB} is stale: rebuild it with `make -C native`")
    return lib


@lru_cache(maxsize=1)
def smctrl_lib() -> ctypes.CDLL:
    lib = _load(SMCTRL_LIB, "plain C, needs only cc")
    vp, i, u64p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)
    lib.bullet_smctrl_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, i]
    lib.bullet_smctrl_open.restype = i
    lib.bullet_smctrl_set_tpc_range.argtypes = [vp, i, i, i]
    lib.bullet_smctrl_set_tpc_range.restype = i
    lib.bullet_smctrl_compute_mask.argtypes = [i, i, i, u64p, u64p]
    lib.bullet_smctrl_compute_mask.restype = i
    for name in ("bullet_smctrl_driver_version", "bullet_smctrl_has_ext",
                 "bullet_smctrl_min_driver", "bullet_smctrl_max_driver"):
        getattr(lib, name).restype = i
    return lib


def stream_handle(stream) -> int:
    """cudaStream_t value of a torch stream, a CUstream, an int, or None (legacy default)."""
    if stream is None:
        return 0
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    return int(stream)


def _smid_check(rc: int, what: str) -> None:
    if rc != 0:
        msg = smid_lib().bullet_smid_error_string(rc)
        raise RuntimeError(f"{what} failed: CUDA error {rc}: {msg.decode() if msg else '?'}")


def smid_launch(stream, blocks: int, spin_us: int, records) -> None:
    """Asynchronous probe on `stream`; `records` is a CUDA int64 tensor [blocks, SMID_FIELDS]."""
    if records.numel() < blocks * SMID_FIELDS:
        raise ValueError(f"records needs {blocks * SMID_FIELDS} int64 values, has {records.numel()}")
    rc = smid_lib().bullet_smid_launch(ctypes.c_void_p(stream_handle(stream)), int(blocks), int(spin_us),
                                       ctypes.c_void_p(records.data_ptr()))
    _smid_check(rc, "bullet_smid_launch")


def smid_probe(stream, blocks: int, spin_us: int) -> list[dict[str, int]]:
    """Synchronous probe: one dict per block (see SMID_FIELD_NAMES)."""
    buf = (ctypes.c_ulonglong * (blocks * SMID_FIELDS))()
    rc = smid_lib().bullet_smid_probe_ex(ctypes.c_void_p(stream_handle(stream)), int(blocks), int(spin_us), buf)
    _smid_check(rc, "bullet_smid_probe_ex")
    vals = list(buf)
    return [dict(zip(SMID_FIELD_NAMES, vals[b * SMID_FIELDS:(b + 1) * SMID_FIELDS])) for b in range(blocks)]


def smid_ids(stream, blocks: int, spin_us: int) -> list[int]:
    """The plain C API: SM id of each block."""
    out = (ctypes.c_int * blocks)()
    rc = smid_lib().bullet_smid_probe(ctypes.c_void_p(stream_handle(stream)), int(blocks), int(spin_us), out)
    _smid_check(rc, "bullet_smid_probe")
    return list(out)


def tpc_disable_mask(first_tpc: int, num_tpcs: int, total_tpcs: int) -> int:
    """libsmctrl mask (set bit = TPC disabled, 128 bits) enabling TPCs [first, first + num)."""
    if not (0 < total_tpcs <= 128 and first_tpc >= 0 and num_tpcs > 0 and first_tpc + num_tpcs <= total_tpcs):
        raise ValueError(f"TPC range [{first_tpc}, {first_tpc + num_tpcs}) of {total_tpcs} is invalid "
                         "(at most 128 TPCs)")
    enabled = ((1 << num_tpcs) - 1) << first_tpc
    return ~enabled & ((1 << 128) - 1)


def smctrl_compute_mask(first_tpc: int, num_tpcs: int, total_tpcs: int) -> int:
    """The shim's mask for the same range (tests compare it with tpc_disable_mask)."""
    lo, hi = ctypes.c_uint64(), ctypes.c_uint64()
    rc = smctrl_lib().bullet_smctrl_compute_mask(first_tpc, num_tpcs, total_tpcs, ctypes.byref(lo), ctypes.byref(hi))
    if rc != 0:
        raise ValueError(f"bullet_smctrl_compute_mask: {SMCTRL_ERRORS.get(rc, rc)}")
    return (hi.value << 64) | lo.value
