"""The decode worker's own copy of its batch, so that it steps on its own.

A decode step of ~100 sequences used to cost a round trip through the orchestrator: pickle
every sequence's BatchItem, step, send the tokens back, wait for the next batch. Here the
worker keeps each sequence's row (last token, position, block table, sampling state) and feeds
each sampled token back itself; the orchestrator only sends what changes: rows that join
(after their prefill), rows that leave (finished, aborted, preempted), blocks granted to a row
and the SM split to run on. A row steps while its next position has a block and it may still
produce a token; the orchestrator grants blocks a little ahead so that rows rarely wait.

Prompts can ride along too: the orchestrator may hand the worker whole prompts to prefill
inside its next step, on the GPU share decode runs on, so that they share the step's pass
over the weights instead of running beside it on a partition of their own (the fused path
of `bullet_trt/spatial/policy.py`). Their results come back with that step. Each update's
prompts ride in a step of their own, in the order sent: the orchestrator may send the next
group while a step carries the last one, and the policy sized each group for a step alone.

A row that leaves may have stepped once or twice more than the orchestrator accepted; those
tokens are dropped there. Its KV blocks are freed only after the worker acknowledges the
leave, so a late step never writes into blocks that another sequence already got.
"""
from __future__ import annotations

from bullet_trt.engine.session import BatchItem
from bullet_trt.protocol import DecodeUpdate, SmSplit


class PersistentDecodeBatch:
    def __init__(self, block_size: int, total_sms: int):
        self.block_size = block_size
        self.rows: dict[int, BatchItem] = {}
        self.split = SmSplit.whole(total_sms)
        self.split_epoch = 0
        self.prompt_groups: list[list[BatchItem]] = []  # one per update that carried prompts
        self.waiting_for_block = 0  # at the last runnable()

    def apply(self, update: DecodeUpdate) -> list[int]:
        """Applies an update; returns the row ids that left (to acknowledge)."""
        leaving = set(update.leaves)
        for row_id in update.leaves:
            self.rows.pop(row_id, None)
        for row_id, item in update.joins:
            if row_id not in leaving:  # else it joined and left within one update
                self.rows[row_id] = item
        for row_id, blocks in update.grants:
            item = self.rows.get(row_id)
            if item is not None:
                item.block_table.extend(blocks)
        if update.split is not None:
            self.split = update.split
            self.split_epoch = update.epoch
        if update.prompts:
            self.prompt_groups.append(list(update.prompts))
        return list(update.leaves)

    def drop(self, ran: list[tuple[int, BatchItem]]) -> list[int]:
        """Takes the rows of a step that failed out of the batch; returns their ids (their
        requests end with the error, the other rows step on)."""
        failed = [row_id for row_id, _ in ran]
        for row_id in failed:
            self.rows.pop(row_id, None)
        return failed

    def take_prompts(self) -> list[BatchItem]:
        """The prompts of the next step: the oldest group waiting, or none."""
        return self.prompt_groups.pop(0) if self.prompt_groups else []

    def runnable(self) -> list[tuple[int, BatchItem]]:
        """Rows whose next position has a block and that may still produce a token. Those
        that may but have no block are counted in `waiting_for_block`: the orchestrator,
        which grants ahead by `serve.grant_lookahead_tokens`, fell that far behind them."""
        bs = self.block_size
        ran, self.waiting_for_block = [], 0
        for row_id, item in self.rows.items():
            if item.output_index < item.params.max_tokens:
                if item.start_pos // bs < len(item.block_table):
                    ran.append((row_id, item))
                else:
                    self.waiting_for_block += 1
        return ran

    def advance(self, ran: list[tuple[int, BatchItem]], token_ids: list[int]) -> None:
        """Feeds each row its sampled token as the next input."""
        self.move_on(ran)
        self.feed(ran, token_ids)

    def move_on(self, ran: list[tuple[int, BatchItem]]) -> None:
        """Moves each row that stepped to its next position, whatever token it sampled: all
        of its next step but its input token (which an overlapped step takes on the device)."""
        for _, item in ran:
            item.start_pos += 1
            item.output_index += 1
            if item.banned_token_ids and item.output_index >= item.params.min_tokens:
                item.banned_token_ids = []

    @staticmethod
    def feed(ran: list[tuple[int, BatchItem]], token_ids: list[int]) -> None:
        """Each row's sampled token, as its next input on the host."""
        for (_, item), token in zip(ran, token_ids):
            item.input_token_ids = [token]
