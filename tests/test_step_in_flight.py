"""A step launched before the last one's tokens reach the host (engine/step_in_flight.py): rows
fed their input token on the device from the step before sample what they sample when the host
hands the same token in, and rows left out of the feed keep their host token."""
from __future__ import annotations

import pytest
import torch

from bullet_trt.config import load_engine_config
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem, TorchSession
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.engine.step_in_flight import TokenFeed
from tests.test_engine import engine_dir_for, prompts


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    engine = engine_dir_for(tmp_path_factory, "llama")[0]
    cfg = load_engine_config(engine, {"kv.num_blocks": "32"})
    state, model = build_shared_state(cfg, share=False)
    return TorchSession(model, state.kv_pool, state.block_size, cfg.decode)


def test_fed_rows_sample_what_host_tokens_give(session):
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=7, logprobs=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    bs = session.block_size
    items = [BatchItem(f"r{i}", p, 0, [4 * i, 4 * i + 1, 4 * i + 2], params, True)
             for i, (p, params) in enumerate(zip(prompts(3, seed=4), [greedy, seeded, greedy]))]
    assert all(len(it.input_token_ids) < 2 * bs for it in items)
    first = session.launch(items)  # the prompts; their tokens stay on the device for the feed
    firsts = [r.token_id for r in first.results()]

    def step(token_ids):
        return [BatchItem(it.request_id, [t], len(it.input_token_ids), it.block_table, it.params, True,
                          output_index=1) for it, t in zip(items, token_ids)]

    pool = session.kv_pool.clone()
    by_host = [(r.token_id, r.logprob) for r in session.run(step(firsts))]
    session.kv_pool.copy_(pool)
    # rows 0 and 2 are fed from the first step (their host tokens are placeholders), in an order
    # unlike the source's; row 1 keeps its host token
    fed = session.launch(step([0, firsts[1], 0]), TokenFeed(first.tokens, rows=[2, 0], src=[2, 0]))
    got = [(r.token_id, r.logprob) for r in fed.results()]
    assert got[0] == by_host[0] and got[2] == by_host[2]
    assert got[1][0] == by_host[1][0] and got[1][1] == pytest.approx(by_host[1][1], abs=1e-6)
    assert got[0][1] is None and got[1][1] is not None  # log-probs only where asked
    session.kv_pool.copy_(pool)
    # a placeholder that is not fed is what the row runs with: the feed is what changed the rows
    unfed = [r.token_id for r in session.run(step([0, firsts[1], 0]))]
    assert unfed != [t for t, _ in by_host]


def test_a_feed_feeds_only_items_of_one_token(session):
    item = BatchItem("r", [5, 6], 0, [0], SamplingParams(max_tokens=2), True)
    with pytest.raises(ValueError, match="only items of one input token"):
        session.launch([item], TokenFeed(torch.zeros(1, dtype=torch.long), [0], [0]))


def test_the_overlapped_loop_changes_split_without_draining_and_publishes_the_epoch_after(session):
    """A new split does not drain the step in flight: the next step is launched on it (on a GPU
    queued behind the step in flight), and the split's epoch, which lets a prefill start on the
    SMs the old split gave decode, is published only once the step on the old split is
    reported. A turn that takes decode to the whole GPU and back (a prefill ends, the next
    starts on the same partition) publishes at once."""
    from bullet_trt.protocol import DecodeStep, DecodeUpdate, SmSplit
    from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
    from bullet_trt.spatial.overlapped_decode import OverlappedDecode
    from bullet_trt.spatial.partitioners import make_partitioner

    class Outbox(list):
        put = list.append

    beside, whole = SmSplit(8, 4), SmSplit.whole(8)
    batch = PersistentDecodeBatch(session.block_size, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    batch.apply(DecodeUpdate(joins=[(r, BatchItem(f"r{r}", [3 + r], 0, [8 + r], params, True)) for r in range(2)],
                             split=beside, epoch=1))
    outbox, published = Outbox(), []
    loop = OverlappedDecode(session, torch.device("cpu"), make_partitioner("none", "cpu"), "decode", None,
                            batch, outbox, None, publish_epoch=published.append)
    loop.step(batch.runnable(), [])
    first = loop.pending
    assert first is not None and first.split == beside and not outbox
    for split, epoch in ((whole, 2), (beside, 3)):  # one turn: to the whole GPU and back
        batch.apply(DecodeUpdate(split=split, epoch=epoch))
    loop.move_to(batch.split, 3)
    assert published == [3] and loop.pending is first and not outbox  # nothing drained
    batch.apply(DecodeUpdate(split=whole, epoch=4))
    loop.move_to(batch.split, 4)
    assert published == [3] and loop.pending is first and not outbox  # due after the old split's step
    loop.step(batch.runnable(), [7])
    assert loop.pending is not first and loop.pending.split == whole
    assert [type(m) for m in outbox] == [DecodeStep] and outbox[0].split == beside and outbox[0].left == [7]
    assert published == [3, 4]  # once the step on the old split was reported
    batch.apply(DecodeUpdate(split=beside, epoch=5))
    loop.move_to(batch.split, 5)
    assert loop.drain([]) == [] and published == [3, 4, 5]  # a drain reports it too
    assert [m.split for m in outbox] == [beside, whole]


def test_a_late_launch_is_due_before_the_step_in_flight_ends_on_its_split(session):
    """`decode.overlap_launch_late`: the next launch is due at the last reported step's end (as
    the host saw it) plus most of that step's time, less the launches' host time and a margin;
    at once where nothing says how long the step in flight takes."""
    from bullet_trt.protocol import DecodeUpdate, SmSplit
    from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
    from bullet_trt.spatial.overlapped_decode import (LATE_LAUNCH_MARGIN_MS, LATE_LAUNCH_SHARE,
                                                      OverlappedDecode)
    from bullet_trt.spatial.partitioners import make_partitioner

    class Outbox(list):
        put = list.append

    beside, whole = SmSplit(8, 4), SmSplit.whole(8)
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def loop_of(late: bool) -> OverlappedDecode:
        batch = PersistentDecodeBatch(session.block_size, 8)
        batch.apply(DecodeUpdate(joins=[(r, BatchItem(f"r{r}", [3 + r], 0, [8 + r], params, True))
                                        for r in range(2)], split=beside, epoch=1))
        return OverlappedDecode(session, torch.device("cpu"), make_partitioner("none", "cpu"), "decode", None,
                                batch, Outbox(), None, launch_late=late)

    plain = loop_of(False)
    plain.step(plain.batch.runnable(), [])
    plain.step(plain.batch.runnable(), [])
    assert plain.launch_due() is None  # not asked for
    late = loop_of(True)
    assert late.launch_due() is None  # nothing in flight
    late.step(late.batch.runnable(), [])
    assert late.launch_due() is None  # nothing reported yet
    late.step(late.batch.runnable(), [])
    seen_end, window_ms, split = late._reported
    assert split == beside == late.pending.split
    lead_ms = max(late._launch_ms) + LATE_LAUNCH_MARGIN_MS
    assert late.launch_due() == pytest.approx(seen_end + (window_ms * LATE_LAUNCH_SHARE - lead_ms) / 1e3)
    late.batch.apply(DecodeUpdate(split=whole, epoch=2))
    late.move_to(late.batch.split, 2)
    late.step(late.batch.runnable(), [])  # in flight on the whole GPU, last reported beside a prefill
    assert late.pending.split == whole and late.launch_due() is None


def test_a_worker_takes_its_messages_until_the_launch_is_due():
    import multiprocessing as mp
    import threading
    import time

    from bullet_trt.spatial.rank_mirror import RankMirror

    inbox = mp.get_context("spawn").Queue()
    mirror = RankMirror(inbox, None)
    inbox.put("before")
    time.sleep(0.2)  # the queue's feeder thread delivers it
    late = threading.Timer(0.1, inbox.put, args=("during",))
    late.start()
    start = time.monotonic()
    assert mirror.take(block=False, until=start + 1.5) == ["before", "during"]
    assert time.monotonic() - start >= 1.5  # waited out the deadline for more
    inbox.put("after")
    written_by = time.monotonic() + 30  # a feeder thread that never writes fails the take below, not the run
    while inbox.empty() and time.monotonic() < written_by:  # until the feeder thread has written it to the pipe
        time.sleep(0.01)
    assert mirror.take(block=False, until=time.monotonic() - 1) == ["after"]  # past due: what is there
    late.join()
