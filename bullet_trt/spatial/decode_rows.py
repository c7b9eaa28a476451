"""The orchestrator's view of the decode worker's batch: which sequence each row is, and
the blocks of rows that left but that the worker may still be stepping.

The decode worker runs ahead of the orchestrator (bullet_trt/spatial/decode_batch.py), so a
row that leaves keeps its blocks until the worker acknowledges the leave; only then do they
return to the pool, and no late step writes into blocks another sequence already got.
Changes accumulate in one DecodeUpdate until `take_update` sends them.
"""
from __future__ import annotations

from bullet_trt.engine.sequence import Sequence
from bullet_trt.engine.session import BatchItem
from bullet_trt.protocol import DecodeUpdate, SmSplit


class DecodeRows:
    def __init__(self) -> None:
        self.rows: dict[int, Sequence] = {}
        self.row_of: dict[str, int] = {}
        self.unacked: dict[int, list[int]] = {}  # row id -> blocks held until acknowledged
        self._next_row = 0
        self.pending = DecodeUpdate()
        self._sent_split: SmSplit | None = None
        self.split_epoch = 0  # the number of the last split sent

    def __bool__(self) -> bool:
        return bool(self.rows or self.unacked)

    def join(self, seq: Sequence, first: BatchItem) -> None:
        row = self._next_row
        self._next_row += 1
        self.rows[row] = seq
        self.row_of[seq.request_id] = row
        self.pending.joins.append((row, first))

    def leave(self, seq: Sequence) -> None:
        """Takes the sequence's row out; its blocks move to the unacknowledged set."""
        row = self.row_of.pop(seq.request_id, None)
        if row is None:
            return
        del self.rows[row]
        self.unacked[row] = seq.block_table
        seq.block_table = []
        self.pending.leaves.append(row)

    def grant(self, row: int, blocks: list[int]) -> None:
        self.pending.grants.append((row, blocks))

    def carry_prompts(self, items: list[BatchItem]) -> None:
        self.pending.prompts += items

    @property
    def pending_blocks(self) -> int:
        """Blocks that come back to the pool once the worker acknowledges the leaves."""
        return sum(len(blocks) for blocks in self.unacked.values())

    def acknowledged(self, rows: list[int]) -> list[int]:
        """The blocks that the acknowledged leaves free."""
        return [b for row in rows for b in self.unacked.pop(row, None) or []]

    def take_update(self, split: SmSplit) -> DecodeUpdate | None:
        """The changes to send, with the split when it differs from the last one sent."""
        if split != self._sent_split:
            self.pending.split = self._sent_split = split
            self.split_epoch += 1
            self.pending.epoch = self.split_epoch
        update, self.pending = self.pending, DecodeUpdate()
        return update if update else None
