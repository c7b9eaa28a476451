"""The host side of a graphed decode step's inputs: token ids, positions, KV slots, sequence
lengths and block tables for a batch padded to its graph's bucket.

The decode step waits for this on the host before its graph replays, so its cost is the
GPU's idle time (an H100's decode steps of 400+ rows ran ~35 ms, with the GPU idle ~1.8 ms
between them besides: 2026-11-26, seventh round's iteration log). Written row by row, a
1024-row batch of 5-40-block tables, one row leaving and one joining a step, took 2.0-2.6 ms of
a two-core development host's time a step; staged as here, 0.65-0.80 ms (`bullet-trt bench
host-step`, which times both). Most of it was copying
block tables that had not changed: a row's table grows by one block every `block_size`
tokens. A table seen in the last step (the same list object, which the staging holds on to,
so that its identity cannot pass to another list) keeps its row: moved with the others in
one copy when rows ahead of it left the batch, and only its new tail written.

That rests on one contract, which every caller keeps: a block-table list handed to two steps
has only grown in between (the decode worker extends its rows' tables by the blocks it is
granted; the engine core hands each step copies). A table that shrank is written whole.
"""
from __future__ import annotations

import numpy as np


class DecodeInputStaging:
    def __init__(self, host_i64: np.ndarray, host_i32: np.ndarray, block_size: int, max_blocks: int):
        """host_i64: (3, n) token ids, positions, KV slots; host_i32: n sequence lengths, then
        n x max_blocks block tables (views of the pinned buffers the step copies from)."""
        self.i64 = host_i64
        n = host_i64.shape[1]
        self.seq_lens = host_i32[:n]
        self.tables = host_i32[n:].reshape(n, max_blocks)
        self.block_size = block_size
        # the last step's tables: their ids (sorted), rows and lengths written
        empty = np.zeros(0, dtype=np.int64)
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] = (empty, empty, empty)
        self._held: list[list[int]] = []
        self._dirty = np.zeros(n, dtype=bool)  # rows holding a table (padding must read block 0)
        self._rows = np.arange(n)

    def fill(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], padded: int) -> None:
        """Writes a batch's inputs and pads it to `padded` rows: padded rows read one token of
        block 0 and write no KV (slot -1)."""
        batch = len(token_ids)
        ids, pos, slots = self.i64
        ids[:batch] = token_ids
        pos[:batch] = positions
        ids[batch:padded] = 0
        pos[batch:padded] = 0
        lengths = self._fill_tables(block_tables)
        stale = np.flatnonzero(self._dirty[batch:padded]) + batch
        if len(stale):
            self.tables[stale] = 0
            self._dirty[stale] = False
        at = pos[:batch]
        bs = self.block_size
        block_of = at // bs
        short = np.flatnonzero(block_of >= lengths)
        if len(short):  # else its slot would come from another table's stale row
            row = int(short[0])
            raise ValueError(f"decode row {row} at position {int(at[row])} has {int(lengths[row])} KV blocks "
                             f"of {bs} tokens: its table does not reach its position")
        slots[:batch] = self.tables[self._rows[:batch], block_of].astype(np.int64) * bs + at % bs
        slots[batch:padded] = -1
        self.seq_lens[:batch] = at + 1
        self.seq_lens[batch:padded] = 1

    def _fill_tables(self, block_tables: list[list[int]]) -> np.ndarray:
        """Writes the batch's tables into its rows; returns their lengths. The last step's
        tables are matched by identity in numpy (the staging holds them, so no live list can
        share an id with one), which leaves Python a loop over the rows that grew or are new."""
        batch = len(block_tables)
        ids = np.fromiter(map(id, block_tables), dtype=np.int64, count=batch)
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=batch)
        last_ids, last_rows, last_lengths = self._last
        rows = self._rows[:batch]
        if len(last_ids):
            at = np.minimum(np.searchsorted(last_ids, ids), len(last_ids) - 1)
            seen = last_ids[at] == ids
            before, written = last_rows[at], last_lengths[at]
            seen &= lengths >= written  # a table that shrank is written whole
        else:
            seen = np.zeros(batch, dtype=bool)
            before = written = rows
        moved = np.flatnonzero(seen & (before != rows))
        if len(moved):
            self.tables[moved] = self.tables[before[moved]]  # the right side is gathered first
        for row in np.flatnonzero(seen & (lengths > written)).tolist():
            start = int(written[row])
            self.tables[row, start:lengths[row]] = block_tables[row][start:]
        for row in np.flatnonzero(~seen).tolist():
            table = block_tables[row]
            self.tables[row, :len(table)] = table
        self._dirty[:batch] = True
        order = np.argsort(ids)
        self._last = (ids[order], rows[order], lengths[order])
        self._held = block_tables  # keeps the tables alive: their ids stay theirs
        return lengths
