"""The packed batch's metadata (kernels/metadata.py), built in numpy, against the same built
from Python lists, token by token, as it was before (`bench host-step` times the two)."""
from __future__ import annotations

import random

import pytest
import torch

from bullet_trt.kernels.metadata import AttentionMetadata, padded_tables
from bullet_trt.tools.bench.host_step import metadata_from_lists


def _mixed_batch(rng: random.Random, decode_rows: int, chunks: list[tuple[int, int]], block_size: int):
    """Decode rows of one token over random contexts, then prompt chunks (cached, new); block
    ids shuffled, tables at times longer than their sequence needs (blocks granted ahead)."""
    q_lens, seq_lens, needs = [], [], []
    for _ in range(decode_rows):
        total = rng.randint(1, 700)
        q_lens.append(1)
        seq_lens.append(total)
    for cached, new in chunks:
        q_lens.append(new)
        seq_lens.append(cached + new)
    for total in seq_lens:
        needs.append(-(-total // block_size) + rng.choice([0, 0, 1]))
    ids = list(range(sum(needs)))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needs:
        tables.append(ids[at:at + n])
        at += n
    return q_lens, seq_lens, tables


@pytest.mark.parametrize("decode_rows, chunks", [(0, [(0, 37)]), (5, []), (120, [(64, 300), (0, 17)]),
                                                 (1, [(0, 1)]), (0, [])])
def test_the_numpy_build_is_the_nested_list_build(decode_rows, chunks):
    rng = random.Random(decode_rows * 31 + len(chunks))
    block_size = 16
    q_lens, seq_lens, tables = _mixed_batch(rng, decode_rows, chunks, block_size)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, "cpu")
    cu, lens, padded, slots = metadata_from_lists(q_lens, seq_lens, tables, block_size)
    for mine, theirs in [(meta.cu_seqlens_q, cu), (meta.seq_lens, lens), (meta.block_tables, padded),
                         (meta.slot_mapping, slots)]:
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs.reshape(mine.shape))
    assert meta.max_seqlen_q == max(q_lens, default=0) and meta.max_seqlen_k == max(seq_lens, default=0)


def test_tables_of_uneven_lengths_pad_with_zeros():
    assert padded_tables([[5, 6, 7], [], [9]]).tolist() == [[5, 6, 7], [0, 0, 0], [9, 0, 0]]
    assert padded_tables([[], []]).tolist() == [[0], [0]]


def test_a_table_too_short_for_its_positions_is_refused_not_read_from_the_padding():
    # Sequence 1 reaches position 32 (its 33rd token) with two blocks of 16: its last token's
    # slot would be the padding's block 0, another sequence's block.
    with pytest.raises(ValueError, match="sequence 1 of the batch reaches position 32 with 2 KV blocks of 16"):
        AttentionMetadata.build([1, 1], [5, 33], [[4], [1, 2]], 16, "cpu")
    # exactly full is fine
    meta = AttentionMetadata.build([1], [32], [[1, 2]], 16, "cpu")
    assert meta.slot_mapping.tolist() == [2 * 16 + 15]
