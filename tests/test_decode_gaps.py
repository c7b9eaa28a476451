"""bullet-trt bench gaps (tools/bench/decode_gaps.py): decode steps' GPU windows and the gaps
between them, per band of batch sizes, from iteration logs in the server's format."""
from __future__ import annotations

import gzip
import json

import pytest

from bullet_trt.tools.bench.decode_gaps import decode_gaps, main


def step(phase: str, batch: int, start_ms: float, end_ms: float) -> dict:
    base = 1_795_695_136_000_000_000  # the GPU timer's epoch is far from zero
    return {"t": start_ms / 1e3, "phase": phase, "batch": batch, "tokens": batch, "sms": 132, "prefill_sms": 0,
            "decode_sms": 132, "predicted_ms": 1.0, "measured_ms": end_ms - start_ms,
            "gpu_start_ns": base + int(start_ms * 1e6), "gpu_end_ns": base + int(end_ms * 1e6)}


def test_gaps_are_measured_to_the_next_decode_step_whatever_runs_between():
    records = [step("decode", 300, 0, 30), step("prefill", 8, 5, 60), step("decode", 310, 32, 62),
               step("fused", 320, 65, 95), step("decode", 20, 100, 108), step("decode", 400, 110, 140)]
    rows = {r["batch"]: r for r in decode_gaps(records)}
    for host, gpu in zip(decode_gaps(records, "host"), decode_gaps(records), strict=True):  # same windows here
        assert host.pop("batch") == gpu.pop("batch") and host == pytest.approx(gpu)
    assert set(rows) == {"1-63", "256-511"}
    big = rows["256-511"]
    assert big["steps"] == 4 and big["window_p50_ms"] == pytest.approx(30)
    # gaps after the 300-, 310- and 320-row steps (2, 3, 5 ms); the last step has none. The 90th
    # percentile interpolates as every report's do (bench/metrics.percentiles): 3 + 0.8 x 2
    assert big["gap_p50_ms"] == pytest.approx(3) and big["gap_p90_ms"] == pytest.approx(4.6)
    assert big["gap_share"] == pytest.approx(10 / (90 + 10))
    small = rows["1-63"]
    assert small["steps"] == 1 and small["gap_p50_ms"] == pytest.approx(2)


def test_the_command_reads_compressed_logs_and_a_log_without_gpu_stamps_on_the_hosts_clock(tmp_path, capsys):
    log = tmp_path / "iterations.jsonl.gz"
    with gzip.open(log, "wt") as f:
        for r in (step("decode", 600, 0, 35), step("decode", 600, 36.5, 71.5), step("decode", 600, 73, 108)):
            f.write(json.dumps(r) + "\n")
    assert main([str(log), "--json"]) == 0
    read = json.loads(capsys.readouterr().out)[str(log)]
    (row,) = read["bands"]
    assert read["clock"] == "gpu" and row["batch"] == "512+" and row["gap_p50_ms"] == pytest.approx(1.5)
    assert main([str(log)]) == 0
    assert "512+" in capsys.readouterr().out
    host_only = tmp_path / "host.jsonl"
    host_only.write_text("".join(json.dumps({k: v for k, v in step("decode", 5, a, b).items() if not k.startswith("gpu")})
                                 + "\n" for a, b in ((0, 1), (4, 5))))
    assert main([str(host_only), "--json"]) == 0
    read = json.loads(capsys.readouterr().out)[str(host_only)]
    assert read["clock"] == "host" and read["bands"][0]["gap_p50_ms"] == pytest.approx(3)
    assert main([str(host_only)]) == 0
    assert "(host clock)" in capsys.readouterr().out


def test_steps_launched_ahead_report_their_launchs_host_time():
    """A launch that waited for its step (the twelfth round's overlapped loop) shows as a launch
    time near the window; plain steps log none and the band reports none."""
    waited = [step("decode", 600, 36 * i, 36 * i + 34) | {"launch_ms": 33.0 + i} for i in range(3)]
    (row,) = decode_gaps(waited)
    assert row["launch_p50_ms"] == pytest.approx(34.0)
    assert "launch_p50_ms" not in decode_gaps([step("decode", 600, 0, 34), step("decode", 600, 36, 70)])[0]


def test_the_gaps_before_a_step_on_another_split_are_told_apart():
    """The overlapped loop drained its step in flight at every change of split (thirteenth
    round): those gaps show as the share of the gaps' time that came before a step whose
    decode partition differs from the step before's."""
    records = [step("decode", 600, 0, 30), step("decode", 600, 33, 63) | {"decode_sms": 84},
               step("decode", 600, 64, 94) | {"decode_sms": 84}, step("decode", 600, 95, 125)]
    (row,) = decode_gaps(records)
    assert row["gap_at_split_share"] == pytest.approx((3 + 1) / (3 + 1 + 1))
    (same,) = decode_gaps([step("decode", 600, 0, 30), step("decode", 600, 32, 62)])
    assert same["gap_at_split_share"] == 0.0


def test_the_sm_time_a_log_held_per_phase():
    """A prefill on 48 SMs beside decode on the other 84, then decode alone on all 132, idle a
    tenth of the time: the shares are each phase's SM-time over the GPU's."""
    from bullet_trt.tools.bench.sm_time import sm_time_shares

    records = [step("prefill", 4, 0, 50) | {"sms": 48, "prefill_sms": 48, "decode_sms": 0},
               step("decode", 300, 0, 50) | {"sms": 84, "prefill_sms": 48, "decode_sms": 84},
               step("decode", 300, 50, 90) | {"sms": 132},
               step("decode", 300, 100, 100.001)]
    held = sm_time_shares(records, middle=(0.0, 1.0))
    span = 100.001 * 132
    assert held["sms"] == 132
    assert held["prefill"] == pytest.approx(50 * 48 / span) and held["decode"] == pytest.approx((50 * 84 + 40 * 132 + 0.001 * 132) / span)
    assert sm_time_shares([{**r, "sms": 0} for r in records]) is None  # a CPU log: no SM counts


def test_what_a_spatial_prefill_ran_on_over_the_middle_of_the_log():
    """Decode over 0-100 ms; prefills of 24 SMs (1000 tokens, 20 ms) and 56 SMs (3000 tokens,
    30 ms) inside the middle 80%, one during the ramp-up left out: the batches' SMs, tokens and
    windows, and the share of 10-90 ms a prefill ran (50 of 80 ms)."""
    from bullet_trt.tools.bench.prefill_partition import prefill_partition

    decode = [step("decode", 300, t, t + 10) | {"sms": 108, "decode_sms": 108} for t in range(0, 100, 10)]
    prefills = [step("prefill", 4, 2, 8) | {"sms": 132, "tokens": 500},
                step("prefill", 8, 20, 40) | {"sms": 24, "tokens": 1000},
                step("prefill", 12, 50, 80) | {"sms": 56, "tokens": 3000}]
    seen = prefill_partition(decode + prefills)
    assert seen["batches"] == 2
    assert (seen["sms_p50"], seen["tokens_p50"], seen["window_p50_ms"]) == pytest.approx((40, 2000, 25))
    assert seen["busy_share"] == pytest.approx(50 / 80)
    assert prefill_partition(decode) is None  # no prefill in the middle of the log
    assert prefill_partition([{**r, "sms": 0} for r in decode + prefills]) is None  # a CPU log


def test_one_phase_reported_apart_with_its_launches_that_outran_their_windows():
    """Chunked's mixed steps launch eager attention between piecewise graphs, its decode steps
    one graph: --phase reports one kind alone, each step's gap still measured to the next step
    of any phase, and the share of launches longer than their step's window."""
    records = [step("mixed", 300, 0, 30) | {"launch_ms": 31.0}, step("decode", 300, 30.5, 45.5) | {"launch_ms": 4.0},
               step("mixed", 300, 47.5, 77.5) | {"launch_ms": 20.0}, step("decode", 300, 78, 93) | {"launch_ms": 4.0}]
    (mixed,) = decode_gaps(records, phase="mixed")
    assert mixed["steps"] == 2 and mixed["window_p50_ms"] == pytest.approx(30)
    assert mixed["gap_p50_ms"] == pytest.approx((0.5 + 0.5) / 2)  # to the decode step after each
    assert mixed["launch_p50_ms"] == pytest.approx(25.5) and mixed["launch_over_window_share"] == 0.5
    (decode,) = decode_gaps(records, phase="decode")
    assert decode["steps"] == 2 and decode["window_p50_ms"] == pytest.approx(15)
    assert decode["gap_p50_ms"] == pytest.approx(2) and decode["launch_over_window_share"] == 0.0
    (both,) = decode_gaps(records)
    assert both["steps"] == 4 and both["launch_over_window_share"] == 0.25
