"""A prefill on a partition starts only once the decode worker runs on the complement: the
orchestrator numbers each new split (an epoch), the decode worker publishes the epoch it
runs at between two of its steps, and the prefill worker waits for it."""
from __future__ import annotations

import multiprocessing
import threading

from bullet_trt.protocol import SmSplit
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
from bullet_trt.spatial.decode_rows import DecodeRows
from bullet_trt.spatial.session_worker import _wait_for_epoch


def test_each_new_split_gets_the_next_epoch_and_an_unchanged_one_none():
    rows = DecodeRows()
    first = rows.take_update(SmSplit(132, 48))
    assert (first.split, first.epoch) == (SmSplit(132, 48), 1)
    assert rows.take_update(SmSplit(132, 48)) is None  # nothing changed: nothing to send
    back = rows.take_update(SmSplit.whole(132))
    assert (back.split, back.epoch, rows.split_epoch) == (SmSplit.whole(132), 2, 2)
    batch = PersistentDecodeBatch(block_size=16, total_sms=132)
    batch.apply(first)
    assert (batch.split, batch.split_epoch) == (SmSplit(132, 48), 1)


def test_the_prefill_worker_waits_until_the_decode_worker_publishes_the_epoch():
    epoch = multiprocessing.get_context("spawn").RawValue("q", 0)
    published = threading.Event()

    def decode_moves():
        published.set()
        epoch.value = 3

    timer = threading.Timer(0.05, decode_moves)
    timer.start()
    _wait_for_epoch(epoch, 3, parent=None, limit_s=120)
    assert published.is_set() and epoch.value == 3  # it returned only after the move
    timer.join()
    assert _wait_for_epoch(epoch, 0, parent=None) == 0.0  # no split to wait for


def test_overlap_report_counts_prefill_time_beside_decode_on_shared_sms():
    from bullet_trt.tools.bench.split_overlap import overlap_report

    def rec(phase, t, ms, p, d, **kw):
        return {"phase": phase, "t": t, "measured_ms": ms, "prefill_sms": p, "decode_sms": d, **kw}

    records = [
        rec("decode", 0.000, 10, 0, 132),          # whole GPU, still running at 5..10 ms
        rec("prefill", 0.005, 100, 48, 0, split_wait_ms=4.0),  # 5..105 ms on 48 SMs
        rec("decode", 0.008, 10, 0, 132),          # whole GPU inside the prefill: 5..18 shares SMs
        rec("decode", 0.020, 10, 48, 84),          # the complement: disjoint
        rec("decode", 0.100, 10, 0, 132),          # whole GPU again from 100: 100..105 shares
        rec("prefill", 0.200, 50, 64, 0, split_wait_ms=2.0),
        rec("decode", 0.210, 20, 48, 84),          # 48-SM complement beside a 64-SM prefill: shares
    ]
    r = overlap_report(records)
    assert (r["total_sms"], r["prefills"], r["decode_steps"], r["split_changes"]) == (132, 2, 5, 1)
    assert r["prefill_time_s"] == 0.15
    assert r["prefill_time_sharing_sms_s"] == 0.038  # 13 (5..18, counted once) + 5 + 20 ms
    assert r["decode_steps_on_whole_gpu"] == 0.6 and r["prefill_split_wait_ms_mean"] == 3.0
