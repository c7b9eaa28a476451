"""Finds and starts tritonserver for model_repository/ (what `bullet-trt serve` runs).

The server binary and its Python backend come from the ``nvidia-pytriton`` wheel::

    <site-packages>/pytriton/tritonserver/bin/tritonserver
    <site-packages>/pytriton/tritonserver/backends/python/libtriton_python.so
    <site-packages>/pytriton/tritonserver/python_backend_stubs/<X.Y>/triton_python_backend_stub
    <site-packages>/nvidia_pytriton.libs/            (bundled shared libraries)

The Python backend needs ``triton_python_backend_stub`` next to ``libtriton_python.so``, built
for the interpreter that will run model.py. We copy the one matching this interpreter into
the wheel's backend directory; when site-packages is read-only we build a backend directory
copy under a cache directory instead.

The stub embeds Python and ignores PYTHONPATH; it finds its interpreter as ``python3`` on
PATH. So the environment we give the server puts this interpreter's bin directory first on
PATH (a virtualenv's site-packages then come with it), adds the directory of this
interpreter's libpython and the bundled libraries to LD_LIBRARY_PATH, and exports
BULLET_PYTHON for the engine process the model spawns.
"""
from __future__ import annotations

import argparse
import filecmp
import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from bullet_trt.serving.tied_exec import tied_command

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL_REPOSITORY = PROJECT_ROOT / "model_repository"
DEFAULT_ENGINE_DIR = PROJECT_ROOT / "engines" / "default"
CACHE_ENV = "BULLET_CACHE_DIR"
STUB = "triton_python_backend_stub"
log = logging.getLogger("bullet_trt.serving.triton")
T = TypeVar("T")
# Loopback unless asked: tritonserver has no authentication, and 2.51's HTTP frontend is
# brought down by a single large request body (docs/serving.md), so a public interface is
# an explicit choice (`--host 0.0.0.0`), best behind a proxy that limits bodies.
DEFAULT_HOST = "127.0.0.1"


class ServerSetupError(RuntimeError):
    pass


@dataclass
class TritonInstall:
    root: Path  # .../pytriton/tritonserver (or /opt/tritonserver)
    binary: Path
    backends: Path  # directory holding python/
    libs: Path | None  # bundled shared libraries (nvidia_pytriton.libs)
    stubs: Path | None  # python_backend_stubs/

    def stub_for(self, version: str | None = None) -> Path:
        version = version or f"{sys.version_info[0]}.{sys.version_info[1]}"
        if self.stubs is None:
            raise ServerSetupError(f"{self.root} ships no python_backend_stubs/")
        path = self.stubs / version / STUB
        if not path.is_file():
            have = sorted(p.name for p in self.stubs.iterdir()) if self.stubs.is_dir() else []
            raise ServerSetupError(f"no Python-backend stub for Python {version} in {self.stubs} "
                                   f"(available: {', '.join(have) or 'none'})")
        return path


def find_triton() -> TritonInstall:
    """The tritonserver of the nvidia-pytriton wheel; $BULLET_TRITON_ROOT or /opt/tritonserver otherwise."""
    env = os.environ.get("BULLET_TRITON_ROOT")
    if env:
        root = Path(env)
        return TritonInstall(root, root / "bin" / "tritonserver", root / "backends", None,
                             root / "python_backend_stubs" if (root / "python_backend_stubs").is_dir() else None)
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        pkg = Path(list(spec.submodule_search_locations)[0])
        root = pkg / "tritonserver"
        if (root / "bin" / "tritonserver").is_file():
            libs = pkg.parent / "nvidia_pytriton.libs"
            return TritonInstall(root, root / "bin" / "tritonserver", root / "backends",
                                 libs if libs.is_dir() else None, root / "python_backend_stubs")
    opt = Path("/opt/tritonserver")
    if (opt / "bin" / "tritonserver").is_file():
        return TritonInstall(opt, opt / "bin" / "tritonserver", opt / "backends", None, None)
    raise ServerSetupError("tritonserver not found: install nvidia-pytriton (scripts/setup.sh does) "
                           "or set BULLET_TRITON_ROOT to a Triton installation")


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bullet_trt"


def prepare_backends(install: TritonInstall, version: str | None = None) -> Path:
    """Returns a backend directory whose python/ holds the stub for this interpreter."""
    python_dir = install.backends / "python"
    if install.stubs is None:  # a full Triton installation brings its own stub
        if not (python_dir / STUB).is_file():
            raise ServerSetupError(f"{python_dir / STUB} not found")
        return install.backends
    src = install.stub_for(version)
    dst = python_dir / STUB
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return install.backends
    try:
        tmp = dst.with_name(f".{STUB}.{os.getpid()}")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
        return install.backends
    except OSError:
        pass  # read-only site-packages: build a private backend directory
    version = version or f"{sys.version_info[0]}.{sys.version_info[1]}"
    target = cache_dir() / f"tritonserver-backends-py{version}" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in python_dir.iterdir():
        if item.is_file():
            shutil.copy2(item, target / item.name)
    shutil.copy2(src, target / STUB)
    return target.parent


def libpython_dir() -> str | None:
    """Directory of this interpreter's libpython, so the stub links the same Python build."""
    libdir = sysconfig.get_config_var("LIBDIR")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if libdir and any(Path(libdir).glob(f"libpython{version}*.so*")):
        return libdir
    return None


def server_env(install: TritonInstall, engine_dir: str | Path | None = None,
               overrides: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir])
    libs = [str(install.libs)] if install.libs else []
    pylib = libpython_dir()
    if pylib:
        libs.append(pylib)
    old = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in libs]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + old)
    env["BULLET_PYTHON"] = sys.executable
    # The engine process is a normal interpreter, which does read PYTHONPATH.
    pp = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PROJECT_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    if engine_dir is not None:
        env["BULLET_ENGINE_DIR"] = str(Path(engine_dir).resolve())
    if overrides:
        env["BULLET_OVERRIDES"] = json.dumps(overrides)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def server_command(install: TritonInstall, backends: Path, model_repository: str | Path,
                   http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                   log_verbose: int = 0, explicit: bool = True, extra: list[str] | None = None,
                   host: str = DEFAULT_HOST) -> list[str]:
    cmd = [str(install.binary), f"--model-repository={model_repository}",
           f"--backend-directory={backends}",
           f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
           "--allow-metrics=true", f"--allow-gpu-metrics={'true' if has_gpu() else 'false'}",
           "--exit-timeout-secs=15", f"--log-verbose={log_verbose}"]
    if explicit:
        # Lets the model unload itself (and so report not ready) when its engine dies.
        cmd += ["--model-control-mode=explicit", "--load-model=*"]
    return cmd + list(extra or [])


def prepare(engine_dir: str | Path | None = None, overrides: dict[str, str] | None = None,
            model_repository: str | Path = DEFAULT_MODEL_REPOSITORY, http_port: int = 8000,
            grpc_port: int = 8001, metrics_port: int = 8002, log_verbose: int = 0,
            explicit: bool = True, extra: list[str] | None = None,
            host: str = DEFAULT_HOST) -> tuple[list[str], dict[str, str]]:
    """The tritonserver command line and environment, with the stub in place."""
    install = find_triton()
    backends = prepare_backends(install)
    cmd = server_command(install, backends, Path(model_repository).resolve(), http_port, grpc_port,
                         metrics_port, log_verbose, explicit, extra, host)
    return cmd, server_env(install, engine_dir, overrides)


def launch(engine_dir=None, overrides=None, log_file=None, **kwargs) -> subprocess.Popen:
    """Starts tritonserver in the background (tests, notebooks, benchmarks); stop it with
    bullet_trt.serving.supervisor.stop_server. It dies with the calling thread's process, so a
    benchmark killed by a timeout leaves no server holding the GPU and its ports for the next
    one; start it from the main thread (tied_exec.py)."""
    cmd, env = prepare(engine_dir, overrides, **kwargs)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    try:
        return subprocess.Popen(tied_command(cmd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=str(PROJECT_ROOT), start_new_session=True)
    finally:
        if log_file:
            out.close()


class ServerNotReady(RuntimeError):
    pass


def wait_until_ready(proc: subprocess.Popen, grpc_url: str, timeout_s: float, model: str = "bullet",
                     log_tail=lambda: "", http_url: str | None = None) -> None:
    """Blocks until tritonserver reports the server and `model` ready, over gRPC and, with
    `http_url`, over HTTP too; raises ServerNotReady (with the log tail) when the process exits
    first or `timeout_s` passes. tritonserver opens its HTTP port after its gRPC one, so a
    client that asks over HTTP the moment gRPC says ready can be refused without the check."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise ServerNotReady(f"tritonserver exited with {proc.returncode} during start-up:\n{log_tail()}")
            try:
                if (client.is_server_ready() and client.is_model_ready(model)
                        and (http_url is None or _http_ready(http_url, model))):
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.monotonic() > deadline:
                raise ServerNotReady(f"tritonserver not ready after {timeout_s:g} s:\n{log_tail()}")
            time.sleep(0.5)
    finally:
        client.close()


def _http_ready(http_url: str, model: str) -> bool:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=5) as r:
        return r.status == 200


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (one bind after another can hand out the same port twice)."""
    ports: list[int] = []
    while len(set(ports)) < n:
        ports = [free_port() for _ in range(n)]
    return ports


PORT_TAKEN = "already in use"  # tritonserver's words when a port it was given is bound by then


def on_free_ports(n: int, start: Callable[[list[int]], T], attempts: int = 3) -> T:
    """``start(ports)`` on n free ports, again on fresh ones when tritonserver found one taken
    (ServerNotReady whose log says so). A port free when picked may be bound before tritonserver,
    which binds its gRPC and HTTP ports only once the model has loaded, gets to it: outgoing
    connections of any process draw from the same range."""
    for attempt in range(attempts):
        try:
            return start(free_ports(n))
        except ServerNotReady as e:
            if PORT_TAKEN not in str(e) or attempt == attempts - 1:
                raise
            log.warning("tritonserver found a port taken; starting again on other ports")
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prepare the tritonserver install and print how to start it.")
    ap.add_argument("--print-env", action="store_true", help="print the environment as shell exports")
    args = ap.parse_args(argv)
    cmd, env = prepare()
    if args.print_env:
        for key in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "BULLET_PYTHON"):
            print(f"export {key}={env[key]!r}")
    print(" ".join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
