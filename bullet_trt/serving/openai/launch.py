"""Starts the OpenAI front end as a child process next to tritonserver, and stops it.

The child exits on its own when its parent dies (parent_death.py); call `launch` from the
thread that lives as long as the parent (the main thread), since Linux ties that signal to
the thread that started the child.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bullet_trt.serving.openai.main import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT
from bullet_trt.serving.triton.server import PROJECT_ROOT


def openai_command(engine_dir: str | Path, grpc_url: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                   model: str = "bullet", chat_template: str | Path | None = None,
                   overrides: dict[str, str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "bullet_trt.serving.openai", "--engine-dir", str(Path(engine_dir).resolve()),
           "--grpc-url", grpc_url, "--host", host, "--port", str(port), "--model", model,
           "--parent-pid", str(os.getpid())]
    if chat_template:
        cmd += ["--chat-template", str(Path(chat_template).resolve())]
    for key, value in (overrides or {}).items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def launch(engine_dir: str | Path, grpc_url: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
           api_key: str | None = None, chat_template: str | Path | None = None,
           overrides: dict[str, str] | None = None, model: str = "bullet",
           log_file: str | Path | None = None) -> subprocess.Popen:
    """The front end's process; its output goes to `log_file`, else to ours."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    cmd = openai_command(engine_dir, grpc_url, host, port, model, chat_template, overrides)
    out = open(log_file, "ab") if log_file else None
    try:
        return subprocess.Popen(cmd, env=env, cwd=str(PROJECT_ROOT), stdout=out,
                                stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()


def wait_until_ready(proc: subprocess.Popen, base_url: str, timeout_s: float = 120.0) -> None:
    """Blocks until the front end answers /health; raises RuntimeError when it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenAI front end exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the OpenAI front end did not answer {base_url}/health within {timeout_s:g} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
