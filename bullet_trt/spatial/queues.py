"""The spatial engine's sequences by phase, over the shared block allocator."""
from __future__ import annotations

from dataclasses import dataclass, field

from bullet_trt.engine.block_allocator import BlockAllocator
from bullet_trt.engine.prefix_cache import admit
from bullet_trt.engine.sequence import Sequence


@dataclass
class SpatialQueues:
    """`waiting` need a prefill (holding no blocks, but one whose prompt rode in part in a fused
    step, serve.fuse_prompt_slices, which holds its whole prompt's); `prefilling` are in the
    prefill worker's batch; `decoding` hold their KV and are rows of the decode worker's batch."""

    allocator: BlockAllocator
    block_size: int
    waiting: list[Sequence] = field(default_factory=list)
    prefilling: list[Sequence] = field(default_factory=list)
    decoding: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def running(self) -> list[Sequence]:
        return self.prefilling + self.decoding

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.num_cached_tokens = 0
        for q in (self.waiting, self.prefilling, self.decoding):
            if seq in q:
                q.remove(seq)

    def reserve(self, seq: Sequence, total_tokens: int) -> bool:
        return self.allocator.grow(seq.block_table, total_tokens, self.block_size)

    def admit(self, seq: Sequence) -> bool:
        """Blocks for a waiting sequence's whole prefill, its cached prefix first (all or
        nothing: engine/prefix_cache.admit)."""
        return admit(self.allocator, seq, self.block_size, lambda s: s.num_tokens)
