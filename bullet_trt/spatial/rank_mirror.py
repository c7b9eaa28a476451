"""A worker's inbox under tensor parallelism: rank 0's worker reads its own inbox and hands
every message it took to the same worker of the other ranks, which take them from there and
never read an inbox. Every rank's worker thus applies the same messages in the same order:
the same RunBatch with the same SmSplit, the same DecodeUpdates, so the same decode rows
step in the same iteration, and the model's collectives pair their forwards. The scheduler
decides once; every rank applies it.

rank 0 hands out a list at each turn of its loop, an empty one too (after its inbox's 1 s
wait), so the others wait at most that long plus a step.
"""
from __future__ import annotations

import queue
import time

from bullet_trt.engine.tp_group import TPGroup
from bullet_trt.protocol import WorkerFatal


class RankMirror:
    def __init__(self, inbox, group: TPGroup | None):
        self.inbox, self.group = inbox, group

    @property
    def leads(self) -> bool:
        return self.group is None or self.group.rank == 0

    def take(self, block: bool, until: float | None = None) -> list:
        """The messages of this turn: those waiting in the inbox (waiting up to 1 s for one
        when ``block``; with ``until``, a time.monotonic() deadline, all that arrive before
        it), or on a follower the ones rank 0's worker took."""
        if not self.leads:
            return self.group.broadcast()
        msgs = []
        while until is not None and (left := until - time.monotonic()) > 0:
            try:
                msgs.append(self.inbox.get(timeout=left))
            except queue.Empty:
                break
        try:
            if not msgs:
                msgs.append(self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        if self.group is not None:
            self.group.broadcast(msgs)
        return msgs


class FollowerOutbox:
    """A follower worker's results are rank 0's: only its failures are worth a message."""

    def __init__(self, outbox):
        self.outbox = outbox

    def put(self, msg) -> None:
        if isinstance(msg, WorkerFatal):
            self.outbox.put(msg)

    def cancel_join_thread(self) -> None:
        self.outbox.cancel_join_thread()
