"""A worker process that hosts one engine session over the shared weights and KV pool.

Messages are small: a list of BatchItems in, a list of SampleResults out. The heavy state
(weights, pool) crosses once, at start-up, as shared-memory / CUDA IPC handles.
"""
from __future__ import annotations

import os
import queue
import traceback

import torch
import torch.multiprocessing as mp


class WorkerDied(RuntimeError):
    pass


def _worker_main(name: str, inbox, outbox) -> None:
    try:
        state, profile, threads = inbox.get()
        if threads:
            torch.set_num_threads(threads)
        from bullet_trt.engine.shared_state import attach_session
        session = attach_session(state, profile)
        outbox.put(("ready", os.getpid()))
    except Exception:
        outbox.put(("error", traceback.format_exc()))
        return
    while True:
        msg = inbox.get()
        if msg[0] == "stop":
            return
        try:
            outbox.put(("ok", session.run(msg[1])))
        except Exception:
            outbox.put(("error", traceback.format_exc()))


class SessionWorker:
    def __init__(self, name: str, state, profile, threads: int | None = None,
                 start_timeout_s: float = 300.0):
        ctx = mp.get_context("spawn")
        self.name = name
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_worker_main, args=(name, self.inbox, self.outbox),
                                name=f"bullet-{name}", daemon=True)
        self.proc.start()
        if threads is None and state.kv_pool.device.type == "cpu":
            threads = max(1, (os.cpu_count() or 2) // 2)
        self.inbox.put((state, profile, threads))
        kind, payload = self._receive(start_timeout_s)
        if kind != "ready":
            raise WorkerDied(f"{name} worker failed to start:\n{payload}")
        self.pid = payload

    def _receive(self, timeout_s: float | None = None):
        waited = 0.0
        while True:
            try:
                return self.outbox.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                if not self.proc.is_alive():
                    raise WorkerDied(f"{self.name} worker exited with code {self.proc.exitcode}")
                if timeout_s is not None and waited >= timeout_s:
                    raise WorkerDied(f"{self.name} worker did not answer in {timeout_s:.0f} s")

    def submit(self, items) -> None:
        self.inbox.put(("run", items))

    def result(self):
        kind, payload = self._receive()
        if kind != "ok":
            raise WorkerDied(f"{self.name} worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put(("stop",))
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
