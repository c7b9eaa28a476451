"""The iteration-log readers that tell what a split costs a decode step: a prefill beside it
(`bench interference`) and fewer SMs (`bench decode-sms`)."""
import json

import pytest

from bullet_trt.tools.bench.decode_sms import decode_sms_report
from bullet_trt.tools.bench.decode_sms import main as decode_sms_main
from bullet_trt.tools.bench.interference import interference_report
from bullet_trt.tools.bench.interference import main as interference_main

TOTAL = 132


def step(phase: str, start_ms: float, ms: float, batch: int, decode_sms: int = 0, prefill_sms: int = 0,
         stamped: bool = True) -> dict:
    rec = {"t": start_ms / 1e3, "phase": phase, "batch": batch, "measured_ms": ms, "decode_sms": decode_sms,
           "prefill_sms": prefill_sms}
    if stamped:
        rec["gpu_start_ns"] = int(start_ms * 1e6)
        rec["gpu_end_ns"] = int((start_ms + ms) * 1e6)
    return rec


def run_with_prefills(beside_ms: dict[int, float], alone_ms: dict[int, float], rows: int = 300,
                      windows: int = 6) -> list[dict]:
    """Prefills of 100 ms on 32 SMs every 300 ms; in each, decode steps on every SM count of
    beside_ms at its duration, and between prefills steps at alone_ms's, all of `rows` rows."""
    records, t = [], 0.0
    for _ in range(windows):
        records.append(step("prefill", t, 100.0, 4, prefill_sms=32))
        for sms, ms in beside_ms.items():  # several decode SM counts take turns, as splits change
            start = t + 1.0
            while start + ms < t + 99.0:
                records.append(step("decode", start, ms, rows, decode_sms=sms))
                start += ms + 0.1
        start = t + 101.0
        for sms, ms in alone_ms.items():
            for _ in range(int(90 // ms)):
                records.append(step("decode", start, ms, rows, decode_sms=sms))
                start += ms + 0.1
        t += 300.0
    return records


def test_interference_compares_a_partitions_steps_beside_a_prefill_with_those_alone():
    # decode on 100 SMs runs 10% slower while the prefill runs on the other 32; on the whole GPU
    # it shares SMs with the prefill and takes 1.5x: a group apart, not in the partition's figure
    beside = run_with_prefills({100: 11.0}, {100: 10.0})
    whole = run_with_prefills({TOTAL: 15.0}, {TOTAL: 10.0})
    report = interference_report(beside + [dict(r, gpu_start_ns=r["gpu_start_ns"] + int(2e12),
                                                 gpu_end_ns=r["gpu_end_ns"] + int(2e12)) for r in whole])
    groups = {g["decode_sms"]: g for g in report["groups"]}
    assert groups[100]["beside_over_alone"] == pytest.approx(1.1) and not groups[100]["shares_sms"]
    assert groups[TOTAL]["beside_over_alone"] == pytest.approx(1.5) and groups[TOTAL]["shares_sms"]
    assert report["partition_beside_over_alone"] == pytest.approx(1.1)
    assert groups[100]["rows"] == "256-511" and groups[100]["alone_rows_p50"] == 300


def test_interference_needs_enough_steps_of_both_kinds_and_the_gpus_stamps(tmp_path, capsys):
    few = run_with_prefills({100: 11.0}, {100: 10.0}, windows=1)
    assert interference_report(few, min_steps=20)["groups"] == []
    assert interference_report(few, min_steps=20)["partition_beside_over_alone"] is None
    unstamped = [dict(r) for r in few]
    for r in unstamped:
        del r["gpu_start_ns"], r["gpu_end_ns"]
    with pytest.raises(ValueError, match="no GPU stamps"):
        interference_report(unstamped)
    log = tmp_path / "host.jsonl"
    log.write_text("".join(f"{json.dumps(r)}\n" for r in unstamped))
    assert interference_main([str(log)]) == 2
    assert "no GPU stamps" in capsys.readouterr().err


def test_decode_sms_sets_a_partitions_steps_beside_the_whole_gpus_at_the_same_rows(tmp_path, capsys):
    # alone: 66 SMs take twice the whole GPU's time (the same SM-time); 100 SMs take 1.2x
    # (0.91x the SM-time); steps with a prefill beside them do not count, nor rows of another bin
    records = run_with_prefills({66: 35.0}, {66: 20.0, TOTAL: 10.0})
    records += [dict(r, gpu_start_ns=r["gpu_start_ns"] + int(2e12), gpu_end_ns=r["gpu_end_ns"] + int(2e12))
                for r in run_with_prefills({}, {100: 12.0, TOTAL: 10.0})]
    records += [dict(r, gpu_start_ns=r["gpu_start_ns"] + int(4e12), gpu_end_ns=r["gpu_end_ns"] + int(4e12))
                for r in run_with_prefills({}, {80: 30.0}, rows=40)]
    report = decode_sms_report(records)
    groups = {g["decode_sms"]: g for g in report["groups"]}
    assert set(groups) == {66, 100}  # 80 SMs ran 0-63 rows, which the whole GPU never did
    assert groups[66]["time_ratio"] == pytest.approx(2.0) and groups[66]["sm_time_ratio"] == pytest.approx(1.0)
    assert groups[100]["time_ratio"] == pytest.approx(1.2)
    assert groups[100]["sm_time_ratio"] == pytest.approx(1.2 * 100 / TOTAL, abs=1e-3)
    assert groups[66]["rows"] == "256-319"
    log = tmp_path / "it.jsonl"
    log.write_text("".join(f"{json.dumps(r)}\n" for r in records))
    assert decode_sms_main([str(log)]) == 0
    assert "| 66 (50%) | 256-319 |" in capsys.readouterr().out
