"""What the decode worker does when one of its steps raises, whichever loop stepped it (the
plain one of session_worker.py or the overlapped one of overlapped_decode.py): the step's rows
(and prompts) end with the error and leave the batch, the other rows step on; unless the
device's context is broken, when the worker reports WorkerFatal and must exit."""
from __future__ import annotations

from bullet_trt.engine.session import BatchItem
from bullet_trt.engine.step_failure import device_usable
from bullet_trt.protocol import DecodeStepFailed, RowsLeft, WorkerFatal
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch


class WorkerBroken(RuntimeError):
    """The device's context is broken: the worker reported WorkerFatal and must exit."""


def fail_decode_step(device, role: str, batch: PersistentDecodeBatch, outbox, ran: list[tuple[int, BatchItem]],
                     trace: str, left: list[int], carried_prompts: bool = False) -> None:
    """Reports the failed step over `ran` (with the leaves in `left`, now acknowledged), or
    raises WorkerBroken after reporting WorkerFatal."""
    if not device_usable(device):
        outbox.put(WorkerFatal(role, trace))
        raise WorkerBroken(trace)
    failed = batch.drop(ran)
    if left:
        outbox.put(RowsLeft(left))
    outbox.put(DecodeStepFailed(trace, failed, carried_prompts))
