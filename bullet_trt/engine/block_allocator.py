"""Hands out fixed-size KV blocks of the shared pool; the only owner of the free list."""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"kv.num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> bool:
        """Extends a block table in place to hold num_tokens; all or nothing."""
        return grow_table(self, table, num_tokens, block_size)

    def release(self, table: list[int]) -> None:
        """Frees every block of a table and empties it."""
        self.free(table)
        table.clear()

    # A pool without a prefix cache (engine/prefix_cache.py has the one with)
    num_cached = hit_tokens = prompt_tokens = 0

    def match_prefix(self, prompt: list[int]) -> list[int]:
        return []

    def count_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        pass

    def returned_by(self, tables) -> int:
        """Blocks that releasing every one of `tables` would make free."""
        return sum(len(t) for t in tables)

    def register_prefix(self, prompt: list[int], table: list[int], computed: int) -> None:
        pass

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)


def grow_table(allocator, table: list[int], num_tokens: int, block_size: int) -> bool:
    """Extends a block table in place from `allocator` to hold num_tokens; all or nothing."""
    need = -(-num_tokens // block_size) - len(table)
    if need <= 0:
        return True
    if need > allocator.num_free:
        return False
    table.extend(allocator.allocate(need))
    return True
