"""A request's life inside the engine: its tokens, its KV blocks and how far it has run."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from bullet_trt.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are in the pool
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    first_token_time: float | None = None
    num_emitted: int = 0  # output tokens already reported to the caller
    # Tokens sampled by a step still in flight, not yet on the host (chunked steps launched one
    # ahead, engine/steps_ahead.py): they count in the sequence's length, and a step that needs
    # one as its input takes it on the device. `lineage` moves on each time the sequence gives
    # its blocks back (it ended or was preempted), so a result for an earlier lineage is dropped.
    num_pending: int = 0
    lineage: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """The tokens on the host: the prompt and the outputs read so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, those still in flight included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, count: int) -> list[int]:
        """all_token_ids[start:start + count] without building the whole list (a decode step
        asks this of every running sequence). A token still in flight reads as 0: the step that
        takes it as input is fed it on the device."""
        prompt = self.prompt_token_ids
        end = start + count
        known = self.num_known_tokens
        if end > known:
            head = self.token_ids(start, known - start) if start < known else []
            return head + [0] * (end - max(start, known))
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):end - len(prompt)]
        if end <= len(prompt):
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[:end - len(prompt)]

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def in_prefill(self) -> bool:
        """True until the pool holds all but the newest token (which decode feeds)."""
        return self.num_uncached > 1 or not self.num_outputs
