"""A tritonserver that `bench serve --start-server` starts for one mode and stops after its
sweep, on free ports, so that one command compares modes."""
from __future__ import annotations

from pathlib import Path

from bullet_trt.serving.supervisor import stop_server
from bullet_trt.serving.triton import server as srv


ENGINE_NOTE = "bullet_trt: "  # how the engine's start-up lines begin in the server's log


class ManagedServer:
    """tritonserver started with the project's launcher, for one mode."""

    def __init__(self, engine_dir: Path, overrides: dict, log_file: Path, model: str = "bullet",
                 start_timeout_s: float = 900.0):
        self.log_file = log_file
        self.model = model
        try:
            srv.on_free_ports(3, lambda ports: self._start(ports, engine_dir, overrides, start_timeout_s))
        except srv.ServerNotReady as e:
            raise RuntimeError(f"{e}\n(log {self.log_file})") from None

    def _start(self, ports: list[int], engine_dir: Path, overrides: dict, timeout_s: float) -> None:
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.proc = srv.launch(engine_dir=engine_dir, overrides=overrides, log_file=self.log_file,
                               http_port=self.http_port, grpc_port=self.grpc_port, metrics_port=self.metrics_port)
        try:
            srv.wait_until_ready(self.proc, self.url, timeout_s, self.model, self._log_tail,
                                 http_url=f"localhost:{self.http_port}")
        except srv.ServerNotReady:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def engine_notes(self) -> list[str]:
        return engine_notes(self.log_file)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop_server(self.proc)


def engine_notes(log_file: Path) -> list[str]:
    """What the engine said about itself while starting (the performance model it took, what
    it sized for the GPU, the graphs it captured): settings that a run's label and overrides
    do not name, such as a sized value, to keep with the run's results."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.removeprefix(ENGINE_NOTE).strip() for line in lines if line.startswith(ENGINE_NOTE)]
