"""Overload shedding: whether the engine takes one more request or refuses it at once.

A request that finds serve.max_queue requests, or serve.max_queue_tokens prompt tokens,
already waiting in the engine (admitted, not yet scheduled) is refused with a retryable error
instead of joining a queue it would wait in for longer than any client waits. Admitted
requests are never dropped.

The bound is checked in the engine process, by the loop that owns the waiting queue, between
two steps: checking and enqueueing are one action of one thread, so a burst cannot overshoot
it. The backend's copy of the engine's stats (the Triton model's) is a step and up to a stats
interval old, and every request of a burst would find the same room free in it. The price is
that a refusal, like an admission, waits for the step in progress to end; never for a slot.
"""
from __future__ import annotations

from dataclasses import dataclass

from bullet_trt.engine.request import EngineStats


@dataclass
class QueueBound:
    max_queue: int
    max_queue_tokens: int = 0  # 0: no bound on tokens

    @classmethod
    def from_config(cls, cfg) -> "QueueBound":
        return cls(cfg.serve.max_queue, cfg.serve.max_queue_tokens)

    def intake(self, stats: EngineStats) -> "Intake":
        """Admission for the requests taken between two steps, from the queue as it is now."""
        return Intake(self, stats.num_waiting, stats.num_waiting_tokens)


@dataclass
class Intake:
    bound: QueueBound
    waiting: int
    waiting_tokens: int

    def refusal(self, num_prompt_tokens: int) -> str | None:
        """Why a request of this many prompt tokens is refused now, or None to admit it."""
        b = self.bound
        if self.waiting >= b.max_queue:
            return (f"server overloaded: {self.waiting} requests are waiting in the engine's queue "
                    f"(serve.max_queue {b.max_queue}); retry later")
        # An empty queue takes any prompt the model fits, or a long one would never be served.
        if b.max_queue_tokens and self.waiting and self.waiting_tokens + num_prompt_tokens > b.max_queue_tokens:
            return (f"server overloaded: the engine's queue holds {self.waiting_tokens} prompt tokens and this "
                    f"request adds {num_prompt_tokens} (serve.max_queue_tokens {b.max_queue_tokens}); retry later")
        return None

    def admitted(self, num_prompt_tokens: int) -> None:
        self.waiting += 1
        self.waiting_tokens += num_prompt_tokens
