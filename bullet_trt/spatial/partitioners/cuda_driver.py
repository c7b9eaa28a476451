"""Raw CUDA driver calls through cuda.bindings, shared by the partitioners and the doctor.

cuda.bindings is imported on first call, not at import time, so that CPU machines
without cuda-python can still import every partitioner and report why one is missing.
"""
from __future__ import annotations


def driver():
    """The cuda.bindings.driver module.

    Callers use `cuda_driver.driver()`, not a from-import of it, so that a test's fake
    driver (monkeypatched here) reaches every call site.
    """
    from cuda.bindings import driver as drv

    return drv


def check(result, what: str):
    """Unwraps a cuda.bindings (CUresult, *values) tuple; RuntimeError on failure."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(getattr(err, "value", err))
    if code != 0:
        name = getattr(err, "name", "?")
        msg = "?"
        try:
            if type(err).__name__ == "cudaError_t":  # cuda.bindings.runtime
                from cuda.bindings import runtime as rt

                m = rt.cudaGetErrorString(err)[1]
            else:
                m = drv.cuGetErrorString(err)[1]
            msg = m.decode() if isinstance(m, bytes) else str(m)
        except Exception:  # noqa: BLE001 - best effort for the message
            pass
        raise RuntimeError(f"{what} failed: {name} ({code}): {msg}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def driver_version() -> int:
    """CUDA version of the driver, e.g. 13000; raises when there is no driver."""
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    return int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))


def device_sm_resource(index: int):
    """(CUdevice, full-device SM CUdevResource) for CUDA ordinal `index`."""
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    dev = check(drv.cuDeviceGet(index), f"cuDeviceGet({index})")
    res = check(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                "cuDeviceGetDevResource(SM)")
    return dev, res
