"""Continuous batching with a token budget: decodes first, then prompt chunks.

Each step every running sequence that has finished its prompt gets one decode token, then the
remaining budget goes to prompt chunks in arrival order (a prompt may be split across steps:
chunked prefill). With a budget equal to the chunk size this is the vLLM/SGLang hybrid batch
that Bullet is compared against. When the pool runs dry the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from bullet_trt.engine.block_allocator import BlockAllocator
from bullet_trt.engine.prefix_cache import admit
from bullet_trt.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.seq.num_cached_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class BatchScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 token_budget: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        return self.allocator.grow(seq.block_table, seq.num_cached_tokens + num_new, self.block_size)

    def release(self, seq: Sequence) -> None:
        """Returns a sequence's blocks to the pool and forgets it. Tokens it had in flight are
        lost with them (a step in flight that still writes its blocks runs before any step
        launched after this, on the same stream)."""
        self.allocator.release(seq.block_table)
        seq.num_cached_tokens = 0
        seq.num_pending = 0
        seq.lineage += 1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self, ends_for_certain: Callable[[Sequence], bool] | None = None) -> StepPlan:
        """The next step's chunks. `ends_for_certain(seq)`: whether a sequence's tokens in flight
        already end it (steps launched one ahead); it then sits this step out."""
        plan = StepPlan([], [], [])
        budget = self.token_budget
        # Decodes: sequences whose prompt is fully cached need one token each.
        for seq in list(self.running):
            if seq.in_prefill or budget <= 0 or (ends_for_certain is not None and ends_for_certain(seq)):
                continue
            while not self._reserve(seq, 1):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                plan.decodes.append(ScheduledChunk(seq, 1))
                budget -= 1
        # Prompt chunks: partially prefilled running sequences first, then new arrivals.
        candidates = [s for s in self.running if s.in_prefill]
        for seq in candidates:
            if budget <= 0:
                break
            n = min(seq.num_uncached, budget)
            if self._reserve(seq, n):
                plan.prefills.append(ScheduledChunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not admit(self.allocator, seq, self.block_size,
                         lambda s: s.num_cached_tokens + min(s.num_uncached, budget)):
                break  # wait for blocks; never preempt running work for a newcomer
            n = min(seq.num_uncached, budget)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.prefills.append(ScheduledChunk(seq, n))
            budget -= n
        return plan
