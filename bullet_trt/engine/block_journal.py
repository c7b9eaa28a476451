"""KV block accounting on every tensor-parallel rank.

Rank 0's allocator alone decides which blocks a sequence gets; it records each allocation and
each free (`JournaledAllocator`), and the journal travels to the other ranks with the next
step it sends them. A follower replays it into its `BlockReplica`: which blocks of its own
pool hold live KV. The replica refuses a journal that hands out a block it holds as taken or
frees one it holds as free, and a step that would write into a block it holds as free, so a
rank that lost track of its pool stops instead of serving from the wrong blocks; its count of
free blocks is what the engine's stats report for that rank.
"""
from __future__ import annotations

from bullet_trt.engine.block_allocator import BlockAllocator
from bullet_trt.engine.session import BatchItem

Journal = list[tuple[bool, list[int]]]  # (taken: True, freed: False), blocks


class JournaledAllocator(BlockAllocator):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.journal: Journal = []

    def allocate(self, n: int) -> list[int]:
        blocks = super().allocate(n)
        if blocks:
            self.journal.append((True, list(blocks)))
        return blocks

    def free(self, blocks: list[int]) -> None:
        super().free(blocks)
        if blocks:
            self.journal.append((False, list(blocks)))

    def take_journal(self) -> Journal:
        journal, self.journal = self.journal, []
        return journal


class BlockReplica:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.used: set[int] = set()

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self.used)

    def replay(self, journal: Journal) -> None:
        for taken, blocks in journal:
            if taken:
                clash = self.used.intersection(blocks)
                if clash:
                    raise RuntimeError(f"rank 0 handed out KV blocks {sorted(clash)[:8]} that this rank holds as taken")
                self.used.update(blocks)
            else:
                missing = set(blocks) - self.used
                if missing:
                    raise RuntimeError(f"rank 0 freed KV blocks {sorted(missing)[:8]} that this rank holds as free")
                self.used.difference_update(blocks)

    def check(self, items: list[BatchItem]) -> None:
        """Every block a step's items write into is one this rank holds as taken."""
        for it in items:
            free = [b for b in it.block_table if b not in self.used]
            if free:
                raise RuntimeError(f"request {it.request_id}: its block table holds KV blocks {free[:8]} "
                                   f"that this rank holds as free")
