"""CUDA MPS for every partitioner: the control daemon, client checks, client environment.

Why MPS matters for every partitioner: without it, kernels of two processes
time-slice and never run at the same time (docs/partitioning.md, "MPS"). The prefill
and decode workers must both be MPS clients, i.e. started with CUDA_MPS_PIPE_DIRECTORY
pointing at a running control daemon (scripts/start_mps.sh).

The static-percentage split (mps.py) is started through the client environment:
worker_env() gives CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, which the driver reads when CUDA
initializes in the worker, so the spawner must set it before the worker starts.

Detecting "this process is an MPS client" (is_mps_client): the driver's device
attribute CU_DEVICE_ATTRIBUTE_MPS_ENABLED ("contexts created on this device will be
shared via MPS"). It is answered by the driver inside the process, needs no daemon
round trip, and is unaffected by PID namespaces (NVML's process lists carry host
PIDs inside containers, so "is our pid listed as M+C" fails there). The doctor
cross-checks it with the daemon's own client list (mps_client_evidence).
"""
from __future__ import annotations

import math
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from bullet_trt.spatial.gpu_monitor import nvml_handle
from bullet_trt.spatial.partitioners import cuda_driver
from bullet_trt.spatial.partitioners.base import SETTING, Partitioner, device_index

SYSTEM_PIPE_DIR = "/tmp/nvidia-mps"  # the driver's default when CUDA_MPS_PIPE_DIRECTORY is unset
SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
ENV_PCT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_TOTAL = "BULLET_MPS_TOTAL_SMS"
ENV_PREFILL = "BULLET_MPS_PREFILL_SMS"


def _user() -> str:
    user = os.environ.get("USER")
    if not user:
        try:
            import pwd

            user = pwd.getpwuid(os.getuid()).pw_name
        except Exception:  # noqa: BLE001
            user = str(os.getuid())
    return user


def private_dirs() -> tuple[str, str]:
    """(pipe dir, log dir) of the private daemon; same defaults as scripts/start_mps.sh."""
    base = f"/tmp/bullet-mps-{_user()}"
    return (os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or f"{base}/pipe",
            os.environ.get("CUDA_MPS_LOG_DIRECTORY") or f"{base}/log")


def client_pipe_dir() -> str:
    """Where a CUDA process started with this environment looks for the daemon."""
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or SYSTEM_PIPE_DIR


def mps_client_env(pipe_dir: str | None = None, log_dir: str | None = None) -> dict[str, str]:
    """Environment that makes a new process a client of the daemon at pipe_dir."""
    p, lg = private_dirs()
    return {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir or p, "CUDA_MPS_LOG_DIRECTORY": log_dir or lg}


def mps_control(command: str, pipe_dir: str | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """Sends one command to nvidia-cuda-mps-control; (returncode, output). rc 127: not installed."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return 127, "nvidia-cuda-mps-control not found on PATH"
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir or client_pipe_dir())
    try:
        r = subprocess.run([exe], input=command + "\n", capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"nvidia-cuda-mps-control did not answer {command!r} within {timeout}s"
    return r.returncode, (r.stdout + r.stderr).strip()


def mps_daemon_running(pipe_dir: str | None = None) -> bool:
    """True when a control daemon listens at pipe_dir (default: CUDA_MPS_PIPE_DIRECTORY
    or /tmp/nvidia-mps): its `control` FIFO exists and get_server_list answers."""
    pipe_dir = pipe_dir or client_pipe_dir()
    control = Path(pipe_dir) / "control"
    try:
        mode = control.stat().st_mode
        # a FIFO on older drivers, a Unix socket on CUDA 13's control daemon
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return False
    except OSError:
        return False
    rc, _ = mps_control("get_server_list", pipe_dir)
    return rc == 0


def mps_server_pids(pipe_dir: str | None = None) -> list[int]:
    rc, out = mps_control("get_server_list", pipe_dir)
    return [int(x) for x in out.split() if x.isdigit()] if rc == 0 else []


def mps_client_pids(pipe_dir: str | None = None) -> list[int]:
    """PIDs of the clients of every server of the daemon (in the daemon's PID namespace)."""
    pids: list[int] = []
    for server in mps_server_pids(pipe_dir):
        rc, out = mps_control(f"get_client_list {server}", pipe_dir)
        if rc == 0:
            pids += [int(x) for x in out.split() if x.isdigit()]
    return pids


def _run_script(name: str, env: dict[str, str], timeout: float = 60) -> str:
    script = SCRIPTS / name
    if not script.is_file():
        raise RuntimeError(f"{script} not found (run from a bullet_trt checkout)")
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                       env=dict(os.environ, **env), timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {r.returncode}): {(r.stdout + r.stderr).strip()}")
    return r.stdout + r.stderr


def start_mps_daemon(pipe_dir: str | None = None, log_dir: str | None = None) -> dict[str, str]:
    """Starts (or finds running) the private daemon; returns the client environment."""
    env = mps_client_env(pipe_dir, log_dir)
    _run_script("start_mps.sh", env)
    return env


def stop_mps_daemon(pipe_dir: str | None = None) -> None:
    """Stops the daemon at pipe_dir (default: the private one); no-op when not running."""
    env = mps_client_env(pipe_dir, None)
    _run_script("kill_mps.sh", env)


def _mps_attribute(index: int) -> bool:
    drv, check = cuda_driver.driver(), cuda_driver.check
    check(drv.cuInit(0), "cuInit")
    dev = check(drv.cuDeviceGet(index), f"cuDeviceGet({index})")
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_MPS_ENABLED", None)
    if attr is None:
        attr = drv.CUdevice_attribute(133)
    return bool(check(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(MPS_ENABLED)"))


def is_mps_client(device=0) -> bool:
    """True when this process's CUDA contexts on `device` go through MPS.

    Primary: CU_DEVICE_ATTRIBUTE_MPS_ENABLED (driver, in-process). Fallback where the
    attribute cannot be read: our PID is in the daemon's client list.
    """
    try:
        return _mps_attribute(device_index(device))
    except Exception:  # noqa: BLE001 - no bindings, no driver, attribute unknown
        pass
    return mps_daemon_running() and os.getpid() in mps_client_pids()


def mps_client_evidence(device=0) -> dict[str, Any]:
    """Every signal we have, for the doctor: attribute, daemon client list, NVML."""
    out: dict[str, Any] = {"pid": os.getpid(), "pipe_dir": client_pipe_dir()}
    try:
        out["device_attribute_mps_enabled"] = _mps_attribute(device_index(device))
    except Exception as e:  # noqa: BLE001
        out["device_attribute_mps_enabled"] = None
        out["device_attribute_error"] = f"{type(e).__name__}: {e}"
    out["daemon_running"] = mps_daemon_running()
    out["daemon_servers"] = mps_server_pids() if out["daemon_running"] else []
    clients = mps_client_pids() if out["daemon_running"] else []
    out["daemon_clients"] = clients
    out["pid_in_daemon_clients"] = os.getpid() in clients
    try:
        import pynvml

        pynvml.nvmlInit()
        h = nvml_handle(pynvml, device_index(device))
        procs = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)
        out["nvml_mps_pids"] = sorted(p.pid for p in procs)
        out["pid_in_nvml_mps"] = os.getpid() in out["nvml_mps_pids"]
    except Exception as e:  # noqa: BLE001
        out["nvml_mps_pids"] = None
        out["nvml_error"] = f"{type(e).__name__}: {e}"
    return out


def require_mps_client(role: str, device=0, setting: str = f"{SETTING}=green") -> None:
    """RuntimeError unless this process is an MPS client (call in each worker)."""
    if is_mps_client(device):
        return
    pipe = client_pipe_dir()
    state = "running" if mps_daemon_running(pipe) else "not running"
    raise RuntimeError(
        f"{role} worker: {setting} needs the MPS daemon: start it with scripts/start_mps.sh or "
        f"`bullet-trt serve --mps on`; without MPS two processes only time-slice. "
        f"(this process looked for the daemon at CUDA_MPS_PIPE_DIRECTORY={pipe}: {state}; "
        "the variable must be set before CUDA initializes)")


def mps_percentages(prefill_sms: int, total_sms: int) -> tuple[int, int]:
    """(prefill %, decode %) of CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for a split; rounded up
    so each role gets at least its SMs (the driver rounds the SM count down to a TPC)."""
    pf = min(100, max(1, math.ceil(100 * prefill_sms / total_sms)))
    dc = min(100, max(1, math.ceil(100 * (total_sms - prefill_sms) / total_sms)))
    return pf, dc


def worker_env(role: str, prefill_sms: int | None, total_sms: int) -> dict[str, str]:
    """Environment for a worker of `role` (set by the spawner, before CUDA initializes)."""
    Partitioner.check_role(role)
    if prefill_sms is None or prefill_sms <= 0 or prefill_sms >= total_sms:
        return {ENV_PCT: "100", ENV_TOTAL: str(total_sms), ENV_PREFILL: "0"}
    pf, dc = mps_percentages(prefill_sms, total_sms)
    return {ENV_PCT: str(pf if role == "prefill" else dc), ENV_TOTAL: str(total_sms),
            ENV_PREFILL: str(prefill_sms)}
