"""Responses sent from a few threads instead of the engine reader's one.

The Python backend's `ResponseSender.send` hands each response to Triton's side of the stub
and waits for it to be taken: an inter-process round trip with the GIL released. Sent one after
another from the engine reader thread, responses left the stored GPU runs at 1.6-4.3 thousand a
second whatever the token rate, so at a few hundred streams each stream heard from the server
only every 50-110 ms, and on two CPU cores that thread spent three quarters of its time waiting
in those round trips (docs/benchmarks.md, "How fast responses leave the server"). Round trips
on several threads overlap. A request's responses all go through the one thread
its shard names, so they leave in order and its final response leaves last.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("bullet_trt.serving.triton")


class Delivery:
    """`put(shard, item)` has `deliver(item)` called on thread `shard % threads`."""

    def __init__(self, threads: int, deliver: Callable[[object], None], name: str = "bullet-send"):
        if threads < 1:
            raise ValueError(f"response_threads must be at least 1, got {threads}")
        self._deliver = deliver
        self._unsent = 0  # items put and not yet delivered (or failed)
        self._idle = threading.Condition()
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def put(self, shard: int, item) -> None:
        with self._idle:
            self._unsent += 1
        self._queues[shard % len(self._queues)].put(item)

    def wait_idle(self, timeout: float) -> bool:
        """Waits until every item put so far has been delivered; False if `timeout` ran out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unsent == 0, timeout)

    def _run(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            try:
                self._deliver(item)
            except Exception:  # one request's failure must not stop the others' responses
                log.exception("bullet: delivering a response failed")
            finally:
                with self._idle:
                    self._unsent -= 1
                    if self._unsent == 0:
                        self._idle.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Delivers what is queued, then stops the threads (waiting at most `timeout`)."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
