"""The decode worker's own batch: which rows step, how a step feeds the next, and how
joins, leaves, grants and splits apply."""
from __future__ import annotations

from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem
from bullet_trt.protocol import DecodeUpdate, SmSplit
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch


def item(pos: int, blocks: list[int], **params) -> BatchItem:
    p = SamplingParams(**{"max_tokens": 8, **params})
    return BatchItem("r", [5], pos, list(blocks), p, True, output_index=1,
                     banned_token_ids=[2] if p.min_tokens > 1 else [])


def test_a_row_steps_only_with_a_block_for_its_position_and_tokens_left():
    batch = PersistentDecodeBatch(block_size=4, total_sms=132)
    left = batch.apply(DecodeUpdate(joins=[(0, item(3, [9])), (1, item(4, [9])), (2, item(2, [7], max_tokens=1))],
                                    split=SmSplit(132, 40)))
    assert left == [] and (batch.split.prefill_sms, batch.split.decode_sms) == (40, 92)
    # row 1 sits at position 4 with one block of 4: no room; row 2 has its one token already
    assert [r for r, _ in batch.runnable()] == [0]
    assert batch.waiting_for_block == 1  # row 1 waits for a grant; row 2 is done, not waiting
    batch.apply(DecodeUpdate(grants=[(1, [11])], split=SmSplit.whole(132)))
    assert [r for r, _ in batch.runnable()] == [0, 1] and batch.split.is_whole and batch.split.decode_sms == 132
    assert batch.waiting_for_block == 0
    assert batch.rows[1].block_table == [9, 11]


def test_advance_feeds_the_sampled_token_and_lifts_the_ban_at_min_tokens():
    batch = PersistentDecodeBatch(block_size=16, total_sms=0)
    batch.apply(DecodeUpdate(joins=[(3, item(10, [1], min_tokens=3))]))
    ran = batch.runnable()
    batch.advance(ran, [42])
    row = batch.rows[3]
    assert (row.input_token_ids, row.start_pos, row.output_index) == ([42], 11, 2)
    assert row.banned_token_ids == [2]  # output index 2 < min_tokens 3: the end id stays banned
    batch.advance(batch.runnable(), [43])
    assert row.output_index == 3 and row.banned_token_ids == []


def test_leaves_are_acknowledged_even_for_rows_that_joined_in_the_same_update():
    batch = PersistentDecodeBatch(block_size=16, total_sms=0)
    batch.apply(DecodeUpdate(joins=[(0, item(1, [1]))]))
    left = batch.apply(DecodeUpdate(joins=[(1, item(1, [2]))], leaves=[0, 1]))
    assert sorted(left) == [0, 1] and batch.rows == {} and batch.runnable() == []


def test_each_updates_prompts_ride_once_in_a_step_of_their_own_in_order():
    batch = PersistentDecodeBatch(block_size=16, total_sms=0)
    first = BatchItem("a", [1, 2, 3], 0, [4], SamplingParams(max_tokens=8), True)
    second = BatchItem("b", [7, 8], 0, [5], SamplingParams(max_tokens=8), True)
    third = BatchItem("c", [9], 0, [6], SamplingParams(max_tokens=8), True)
    update = DecodeUpdate(prompts=[first, second])
    assert update  # an update that only carries prompts is still sent
    batch.apply(update)
    batch.apply(DecodeUpdate(grants=[(0, [1])]))  # no prompts: no group
    batch.apply(DecodeUpdate(prompts=[third]))  # sent while the step with the first group runs
    # the policy sized each group for a step of its own: the second waits for the next step
    assert batch.take_prompts() == [first, second]
    assert batch.take_prompts() == [third]
    assert batch.take_prompts() == [] and batch.runnable() == []  # prompts never become rows here


def test_a_split_that_leaves_a_phase_nothing_is_the_whole_gpu():
    assert SmSplit(132, 0).is_whole and SmSplit(132, 132).is_whole and SmSplit(132, None).is_whole
    s = SmSplit(132, 48)
    assert (s.sms_of("prefill"), s.sms_of("decode")) == (48, 84) and not s.is_whole
    assert SmSplit.whole(132).sms_of("prefill") == SmSplit.whole(132).sms_of("decode") == 132
