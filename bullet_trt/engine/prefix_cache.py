"""Automatic prefix caching: the full KV blocks of prompts already computed stay in the pool after
their sequence ends, and a later prompt that starts with the same tokens takes them instead of
computing them again (kv.prefix_caching).

A block is known by its parent block and its own tokens, so a lookup walks a prompt block by
block from its first and stops at the first block not held: two blocks match only where every
token before them matched too, and the check is exact (no hash stands in for the tokens). A
cached block counts the sequences holding it; one that no sequence holds is idle, still in the
pool but free to take back: the allocator hands out free blocks first, then evicts idle ones,
least recently released first, each with the cached blocks that continue it (they could only
be reached through it). Only prompt blocks are cached, and only once the step that wrote them
has succeeded; a prompt keeps at least its last token to compute, whose logits give the first
output token.

Composed over the pool's BlockAllocator with the same interface, so the schedulers keep
calling grow and release; `num_free` counts the idle blocks, which any allocation may take.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from bullet_trt.engine.block_allocator import BlockAllocator, OutOfBlocks, grow_table
from bullet_trt.engine.block_journal import JournaledAllocator
from bullet_trt.engine.sequence import Sequence

ROOT = -1  # the parent of a prompt's first block


class PrefixCachingAllocator:
    def __init__(self, pool: BlockAllocator, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.num_blocks
        self._block_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = {}
        self._holders: dict[int, int] = {}  # cached block -> sequences holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by none; oldest release first
        self.hit_tokens = 0  # prompt tokens found cached since start
        self.prompt_tokens = 0  # prompt tokens looked up since start

    # -- the allocator's interface ------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks held by no sequence, kept for a prompt that starts the same way."""
        return len(self._idle)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        while self.pool.num_free < n:
            self._evict(next(iter(self._idle)))
        return self.pool.allocate(n)

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> bool:
        return grow_table(self, table, num_tokens, block_size)

    def release(self, table: list[int]) -> None:
        self.free(table)
        table.clear()

    def free(self, blocks: list[int]) -> None:
        own = []
        for b in blocks:
            if b not in self._key_of:
                own.append(b)
                continue
            if b not in self._holders:  # idle: no sequence holds it
                raise ValueError(f"KV block {b} freed twice or never allocated")
            self._holders[b] -= 1
            if self._holders[b] == 0:
                del self._holders[b]
                self._idle[b] = None
        self.pool.free(own)

    def returned_by(self, tables) -> int:
        """Blocks that releasing every one of `tables` would make free or idle: a cached block
        only where those tables hold it as often as it is held."""
        times = Counter(b for t in tables for b in t)
        return sum(1 for b, n in times.items() if b not in self._key_of or self._holders[b] == n)

    # -- prefixes -----------------------------------------------------------------------------
    def match_prefix(self, prompt: list[int]) -> list[int]:
        """The cached blocks that begin `prompt`, now held by the caller's sequence (its first
        block table); at most all but the block of its last token."""
        bs = self.block_size
        blocks, parent = [], ROOT
        for k in range((len(prompt) - 1) // bs):
            b = self._block_of.get((parent, tuple(prompt[k * bs:(k + 1) * bs])))
            if b is None:
                break
            blocks.append(b)
            parent = b
        for b in blocks:
            self._holders[b] = self._holders.get(b, 0) + 1
            self._idle.pop(b, None)
        return blocks

    def count_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """A prompt admitted with `hit_tokens` of its `prompt_tokens` found cached."""
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def register_prefix(self, prompt: list[int], table: list[int], computed: int) -> None:
        """The sequence's prompt blocks whose tokens are all computed (the first `computed`
        tokens are in the pool) become findable. A block whose tokens another block already
        holds stays the sequence's own, and so do the ones after it."""
        bs = self.block_size
        parent = ROOT
        for k in range(min(computed, len(prompt)) // bs):
            b = table[k]
            if b not in self._key_of:
                key = (parent, tuple(prompt[k * bs:(k + 1) * bs]))
                if key in self._block_of:
                    return
                self._block_of[key], self._key_of[b] = b, key
                self._children.setdefault(parent, set()).add(b)
                self._holders[b] = 1
            parent = b

    def _evict(self, block: int) -> None:
        """An idle block back to the pool, and the cached blocks after it (idle too: a sequence
        holding one holds its whole chain)."""
        for child in list(self._children.pop(block, ())):
            self._evict(child)
        key = self._key_of.pop(block)
        del self._block_of[key]
        self._children.get(key[0], set()).discard(block)
        self._idle.pop(block)
        self.pool.free([block])


def admit(allocator, seq: Sequence, block_size: int, tokens_after_prefix) -> bool:
    """Blocks for a sequence leaving the queue for its prefill: the cached blocks its prompt
    begins with, when it holds none (a new or preempted sequence), then enough for
    `tokens_after_prefix(seq)` tokens in all, counted once the cached part is known. All or
    nothing: when the pool cannot give the rest, the cached blocks go back and the sequence
    waits holding none, so waiting sequences never keep blocks from the running ones."""
    fresh = not seq.block_table and not seq.num_cached_tokens
    if fresh:
        seq.block_table.extend(allocator.match_prefix(seq.prompt_token_ids))
        seq.num_cached_tokens = len(seq.block_table) * block_size
    if allocator.grow(seq.block_table, tokens_after_prefix(seq), block_size):
        if fresh:
            allocator.count_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
        return True
    if fresh:
        allocator.release(seq.block_table)
        seq.num_cached_tokens = 0
    return False


def engine_allocator(num_blocks: int, block_size: int, journaled: bool, prefix_caching: bool):
    """The allocator an engine's scheduler uses: the pool's free list (journaled for the other
    tensor-parallel ranks), under a prefix cache with kv.prefix_caching."""
    pool = (JournaledAllocator if journaled else BlockAllocator)(num_blocks)
    return PrefixCachingAllocator(pool, block_size) if prefix_caching else pool


def prefix_stats(allocator) -> dict[str, int]:
    """The cache's figures in EngineStats' terms."""
    return {"kv_blocks_cached": allocator.num_cached, "prefix_cache_hit_tokens": allocator.hit_tokens,
            "prefix_cache_prompt_tokens": allocator.prompt_tokens}
