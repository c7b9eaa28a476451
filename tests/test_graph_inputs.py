"""A graphed decode step's host inputs (engine/graph_inputs.py): what a step stages is what
writing every row from scratch stages, whichever rows joined, left, moved or grew since the
last step."""
from __future__ import annotations

import random

import numpy as np
import pytest

from bullet_trt.engine.graph_inputs import DecodeInputStaging
from bullet_trt.tools.bench.host_step import stage_from_scratch

BLOCK = 4
MAX_BLOCKS = 8
ROWS = 16


def staging() -> tuple[DecodeInputStaging, np.ndarray, np.ndarray]:
    i64 = np.zeros((3, ROWS), dtype=np.int64)
    i32 = np.zeros(ROWS + ROWS * MAX_BLOCKS, dtype=np.int32)
    return DecodeInputStaging(i64, i32, BLOCK, MAX_BLOCKS), i64, i32


def from_scratch(token_ids, positions, tables, padded):
    """The inputs written row by row, as a step wrote them before the staging kept its rows."""
    i64 = np.zeros((3, ROWS), dtype=np.int64)
    i32 = np.zeros(ROWS + ROWS * MAX_BLOCKS, dtype=np.int32)
    stage_from_scratch(i64, i32, BLOCK, token_ids, positions, tables, padded)
    return i64, i32


def same_as_from_scratch(i64, i32, token_ids, positions, tables, padded):
    want64, want32 = from_scratch(token_ids, positions, tables, padded)
    batch = len(token_ids)
    assert (i64[:, :padded] == want64[:, :padded]).all()
    assert (i32[:padded] == want32[:padded]).all()
    got = i32[ROWS:].reshape(ROWS, MAX_BLOCKS)
    want = want32[ROWS:].reshape(ROWS, MAX_BLOCKS)
    for row, t in enumerate(tables):  # a row's entries past its table are never read
        assert (got[row, :len(t)] == want[row, :len(t)]).all()
    assert (got[batch:padded] == 0).all()  # padding reads block 0


class Row:
    def __init__(self, table: list[int], position: int):
        self.table, self.position, self.token = table, position, 1


def test_rows_that_join_leave_move_and_grow_stage_what_a_fresh_write_stages():
    rng = random.Random(0)
    stage, i64, i32 = staging()
    next_block = 0
    rows: list[Row] = []
    for step in range(300):
        if rows and rng.random() < 0.3:  # a row leaves: the ones behind it move up
            rows.pop(rng.randrange(len(rows)))
        while len(rows) < ROWS and rng.random() < 0.4:  # a row joins with its prompt's blocks
            n = rng.randint(1, 3)
            rows.insert(rng.randrange(len(rows) + 1), Row(list(range(next_block, next_block + n)), n * BLOCK - 1))
            next_block += n
        for row in rows:  # each steps a token; a row at a block's end is granted the next
            row.position += 1
            row.token = rng.randrange(1000)
            if row.position // BLOCK >= len(row.table):
                if len(row.table) == MAX_BLOCKS:
                    row.position -= 1
                    continue
                row.table.append(next_block)  # the same list object, grown
                next_block += 1
        if not rows:
            continue
        padded = min(ROWS, 1 << (len(rows) - 1).bit_length())
        args = ([r.token for r in rows], [r.position for r in rows], [r.table for r in rows])
        stage.fill(*args, padded)
        same_as_from_scratch(i64, i32, *args, padded)


def test_a_table_that_shrank_or_was_replaced_is_written_whole():
    stage, i64, i32 = staging()
    table = [5, 6, 7]
    stage.fill([1], [9], [table], 1)
    table[:] = [8]  # not what a caller may do; written whole all the same
    stage.fill([1], [2], [table], 1)
    same_as_from_scratch(i64, i32, [1], [2], [table], 1)
    other = [9, 10]
    stage.fill([1], [5], [other], 2)
    same_as_from_scratch(i64, i32, [1], [5], [other], 2)


def test_a_row_whose_table_does_not_reach_its_position_is_refused():
    stage, _, _ = staging()
    with pytest.raises(ValueError, match="decode row 1 at position 8 has 2 KV blocks"):
        stage.fill([1, 1], [0, 8], [[3], [4, 5]], 2)
