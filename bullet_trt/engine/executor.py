"""Where sessions run: in this process, or in a prefill and a decode worker process.

Both build one copy of the weights and one KV pool here (shared memory on CPU; on GPU the
workers attach the tensors through CUDA IPC) and route prompt chunks to the prefill session
and decode tokens to the decode session.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from bullet_trt.engine.session import BatchItem, SampleResult
from bullet_trt.engine.step_failure import device_usable


class Executor(ABC):
    @abstractmethod
    def run(self, prefill: list[BatchItem], decode: list[BatchItem]) -> tuple[list, list]:
        """Runs one step; returns the SampleResults of (prefill, decode) items in order."""

    def recoverable(self) -> bool:
        """Whether the engine may go on after run() raised (the step's requests fail, the
        rest are served). A dead worker process is not."""
        return False

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    """One session in this process runs prefill chunks and decodes as one hybrid batch."""

    def __init__(self, session):
        self.session = session

    def run(self, prefill: list[BatchItem], decode: list[BatchItem]):
        results = self.session.run(decode + prefill)
        return results[len(decode):], results[:len(decode)]

    def recoverable(self) -> bool:
        return device_usable(self.session.device)


class WorkerExecutor(Executor):
    """A prefill worker and a decode worker, each its own process with its own session."""

    def __init__(self, state, prefill_profile, decode_profile):
        from bullet_trt.spatial.session_worker import SessionWorker
        self.prefill_worker = SessionWorker("prefill", state, prefill_profile)
        self.decode_worker = SessionWorker("decode", state, decode_profile)

    def run(self, prefill: list[BatchItem], decode: list[BatchItem]):
        # Submit both before waiting on either: the two processes run at the same time.
        if prefill:
            self.prefill_worker.submit(prefill)
        if decode:
            self.decode_worker.submit(decode)
        pre: list[SampleResult | None] = self.prefill_worker.result() if prefill else []
        dec: list[SampleResult | None] = self.decode_worker.result() if decode else []
        return pre, dec

    def close(self) -> None:
        self.prefill_worker.close()
        self.decode_worker.close()
