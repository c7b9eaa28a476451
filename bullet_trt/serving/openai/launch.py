"""Starts the OpenAI front end as a child process next to tritonserver, and stops it.

The child exits on its own when its parent dies (parent_death.py); call `launch` from the
thread that lives as long as the parent (the main thread), since Linux ties that signal to
the thread that started the child.
"""
from __future__ import annotations

import argparse
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


def add_cli_arguments(ap: argparse.ArgumentParser) -> None:
    """The front end's options of `bullet-trt serve` and `bullet-trt demo`."""
    ap.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible API")
    ap.add_argument("--openai-port", type=int, default=DEFAULT_PORT, help="port of the OpenAI-compatible API")
    ap.add_argument("--openai-host", default=DEFAULT_HOST,
                    help="address the OpenAI-compatible API listens on (0.0.0.0: every interface)")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                    help=f"require 'Authorization: Bearer KEY' on the OpenAI API (default: ${API_KEY_ENV})")
    ap.add_argument("--chat-template", help="Jinja chat template for /v1/chat/completions in place of the "
                                            "checkpoint's (a .jinja file or a tokenizer_config.json)")


def launch_arguments(args: argparse.Namespace, engine_dir: str | Path, grpc_port: int,
                     overrides: dict[str, str] | None = None) -> dict:
    """`launch`'s keyword arguments (all but api_key) from those options."""
    return dict(engine_dir=engine_dir, grpc_url=f"127.0.0.1:{grpc_port}", host=args.openai_host,
                port=args.openai_port, chat_template=args.chat_template, overrides=overrides)


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
