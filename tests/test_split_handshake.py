"""A prefill on a partition starts only once the decode worker runs on the complement: the
orchestrator numbers each new split (an epoch), the decode worker publishes the epoch it
runs at between two of its steps, and the prefill worker waits for it."""
from __future__ import annotations

import multiprocessing
import threading

import pytest

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
    # SM-time from 5 to 250 ms (245 ms x 132 SMs): held twice 5..18 and 100..105 (48 SMs too
    # many) and 210..230 (16); idle 18..20 and 30..100 (84 SMs), 110..200 (all 132), 200..210
    # and 230..250 (68)
    assert r["sm_time_held_twice_share"] == round((48 * 18 + 16 * 20) / (245 * 132), 4)
    assert r["sm_time_idle_share"] == round((84 * 72 + 132 * 90 + 68 * 30) / (245 * 132), 4)


def test_overlap_report_prefers_the_gpu_clock_and_says_what_the_host_clock_would_have_added():
    """Host windows count launch and synchronize latency, so they can overlap where the GPU's
    stamps show the steps one after the other; the report uses the stamps when every step
    has them (ns since an epoch: too large for a float's precision unless offset first)."""
    from bullet_trt.tools.bench.split_overlap import overlap_report
    epoch = 1_764_000_000_000_000_000  # a globaltimer reading in 2025: ~1.8e18 ns

    def rec(phase, t, ms, p, d, gpu_ms):
        start_ns = epoch + int(gpu_ms[0] * 1e6)
        return {"phase": phase, "t": t, "measured_ms": ms, "prefill_sms": p, "decode_sms": d,
                "gpu_start_ns": start_ns, "gpu_end_ns": epoch + int(gpu_ms[1] * 1e6)}

    records = [
        # host: decode 0..12 ms on the whole GPU, prefill from 10 ms: 2 ms shared
        # GPU: the decode step's kernels ended at 9.5 ms, the prefill's began at 10.2 ms
        rec("decode", 0.000, 12, 0, 132, (0.3, 9.5)),
        rec("prefill", 0.010, 40, 48, 0, (10.2, 48.2)),
        rec("decode", 0.012, 10, 48, 84, (12.4, 21.0)),  # the complement: disjoint on both clocks
    ]
    r = overlap_report(records)
    assert r["clock"] == "gpu"
    assert r["prefill_time_s"] == 0.038 and r["prefill_time_sharing_sms_s"] == 0.0
    assert r["host_clock_prefill_share_sharing_sms"] == 0.05  # 2 of 40 ms
    # over the prefill's 38 ms, the 84 decode SMs were held only 12.4..21.0 ms: 29.4 ms x 84 SMs idle
    assert r["sm_time_idle_share"] == round(84 * 29.4 / (132 * 38), 4) and r["sm_time_held_twice_share"] == 0.0
    del records[0]["gpu_start_ns"]  # one step unstamped: the host clock for all
    r = overlap_report(records)
    assert r["clock"] == "host" and r["prefill_share_sharing_sms"] == 0.05
    assert "host_clock_prefill_share_sharing_sms" not in r


def test_the_iteration_log_keeps_the_gpu_window_of_a_step(tmp_path):
    import json
    from types import SimpleNamespace

    from bullet_trt.spatial.iteration_log import IterationLog

    log = IterationLog(str(tmp_path / "it.jsonl"), gpu_index=None, partitioned=True)
    queues = SimpleNamespace(waiting=[], prefilling=[], decoding=[1, 2])
    log.record("decode", SmSplit(132, 48), log.t0 + 0.5, log.t0 + 0.52, 2, 2, 9.0, 10.0, queues,
               gpu_window_ns=(1_000_000_000_123, 1_000_010_000_456))
    log.record("decode", SmSplit(132, 48), log.t0 + 0.6, log.t0 + 0.62, 2, 2, 9.0, 10.0, queues)
    log.close()
    first, second = (json.loads(line) for line in (tmp_path / "it.jsonl").read_text().splitlines())
    assert (first["gpu_start_ns"], first["gpu_end_ns"]) == (1_000_000_000_123, 1_000_010_000_456)
    assert "gpu_start_ns" not in second and second["decode_sms"] == 84


def test_split_timeline_is_drawn_on_the_gpu_clock_from_a_gzipped_log(tmp_path):
    import gzip
    import json

    from bullet_trt.tools.bench.iteration_records import load
    from bullet_trt.tools.bench.plot_iterations import plot
    epoch = 1_764_000_000_000_000_000
    # host times 100 s after the server started; GPU stamps from 0 ms on the GPU's timer
    records = [{"phase": phase, "t": 100.0 + i / 100, "measured_ms": 9.0, "sms": sms,
                "prefill_sms": p, "decode_sms": d, "waiting": 1, "decoding": 3, "prefilling": 1,
                "gpu_start_ns": epoch + i * 10_000_000, "gpu_end_ns": epoch + i * 10_000_000 + 9_000_000}
               for i, (phase, sms, p, d) in enumerate([("decode", 132, 0, 132), ("prefill", 48, 48, 0),
                                                       ("decode", 84, 48, 84)])]
    log = tmp_path / "iterations.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert load(log) == records
    import lzma
    xz_log = tmp_path / "iterations.jsonl.xz"
    with lzma.open(xz_log, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert load(xz_log) == records
    png = plot(load(log), tmp_path / "zoom.png", start=0.0, end=0.05)  # seconds of the GPU clock
    assert png.stat().st_size > 1000
    for r in records:
        del r["gpu_start_ns"], r["gpu_end_ns"]
    with pytest.raises(ValueError, match="no iteration in the window"):
        plot(records, tmp_path / "host.png", start=0.0, end=0.05)  # the host clock starts at 100 s
    assert plot(records, tmp_path / "host.png", start=100.0, end=100.05).stat().st_size > 1000
