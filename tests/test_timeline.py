"""`bench timeline`: a bullet run's phases window by window and its prefill batches' cost beside
decode, read from an iteration log."""
import gzip
import json

import pytest

from bullet_trt.tools.bench.timeline import main, markdown, timeline_report


def prefill(t: float, prompts: int, tokens: int, ms: float, sms: int, decode_sms: int, predicted: float) -> dict:
    return {"t": t, "phase": "prefill", "batch": prompts, "tokens": tokens, "measured_ms": ms,
            "predicted_ms": predicted, "prefill_sms": sms, "decode_sms": decode_sms, "waiting": 0}


def decode(t: float, rows: int, ms: float, sms: int, waiting: int = 0) -> dict:
    return {"t": t, "phase": "decode", "batch": rows, "tokens": rows, "measured_ms": ms, "prefill_sms": 0,
            "decode_sms": sms, "waiting": waiting}


def run_log() -> list[dict]:
    """Ten seconds with prefill on 40 SMs, 10% busy; ten with it on 24 SMs beside decode on 108,
    its batches costing 60 ms plus 70 ms per 1000 tokens, back to back (busy 100%); a burst of
    prompts waiting in the second."""
    log = [prefill(0.5 + i, 4, 500, 100.0, 40, 92, 100.0) for i in range(10)]
    log += [decode(0.05 * i, 300, 40.0, 92) for i in range(100)]
    t = 10.0
    for i in range(60):
        tokens = 1000 + 100 * (i % 11)
        ms = 60.0 + 0.07 * tokens
        log.append(prefill(t, 10, tokens, ms, 24, 108, ms / 1.02))
        t += ms / 1e3
    log += [decode(10.0 + 0.045 * i, 800, 45.0, 108, waiting=70 if i == 50 else 5) for i in range(200)]
    return log


def test_the_timeline_shows_each_phase_per_window_and_the_prefills_line():
    log = run_log()
    report = timeline_report(log, window_s=10.0, min_batches=10)
    first, second = report["windows"][:2]
    assert (first["prefill_batches"], first["prompts_p50"], first["prefill_sms_p50"]) == (10, 4, 40)
    assert first["prefill_busy"] == pytest.approx(0.1)
    assert (first["decode_steps"], first["rows_p50"], first["decode_sms_p50"]) == (100, 300, 92)
    assert second["prefill_sms_p50"] == 24 and second["decode_sms_p50"] == 108
    assert second["prefill_busy"] > 0.9 and second["waiting_max"] == 70
    fits = {f["prefill_sms"]: f for f in report["prefill_fits"]}
    assert fits[24]["ms_per_1000_tokens"] == pytest.approx(70.0) and fits[24]["ms_per_batch"] == pytest.approx(60.0)
    assert fits[24]["measured_over_predicted_p50"] == pytest.approx(1.02)
    assert 40 not in fits  # its batches are all of one size: no line through them


def test_the_command_reads_a_compressed_log_and_prints_both_tables(tmp_path, capsys):
    path = tmp_path / "iterations.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in run_log())
    assert main([str(path), "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert "| 10 | " in out and "| 24 | 60 |" in out
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefill_fits"][0]["prefill_sms"] == 24


def test_an_empty_log_or_window_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert main([str(path)]) == 2
    assert "no steps" in capsys.readouterr().err
    path.write_text(json.dumps(decode(0.0, 1, 5.0, 132)) + "\n")
    assert main([str(path), "--window", "0"]) == 2
    assert "--window must be > 0" in capsys.readouterr().err


def stamped(record: dict, start_s: float, gpu_ms: float, predicted: float | None = None) -> dict:
    record = dict(record, gpu_start_ns=int(start_s * 1e9), gpu_end_ns=int((start_s + gpu_ms / 1e3) * 1e9))
    if predicted is not None:
        record["predicted_ms"] = predicted
    return record


def test_decode_steps_against_their_prediction_per_band_of_rows_and_place():
    """A prefill on 32 SMs runs from 0 to 1 s; decode on the other 100 runs 1.1x its prediction
    beside it, as predicted after it; on the whole GPU it runs 0.9x. A step half beside the
    prefill is left out: its prediction means neither."""
    log = [stamped(prefill(0.0, 8, 2000, 1000.0, 32, 100, 900.0), 0.0, 1000.0)]
    log += [stamped(decode(0.04 * i, 1100, 44.0, 100), 0.04 * i, 44.0, 40.0) for i in range(20)]  # 0-0.84 s
    log += [stamped(decode(0.98, 1100, 40.0, 100), 0.98, 40.0, 40.0)]  # half beside it
    log += [stamped(decode(1.1 + 0.04 * i, 1100, 40.0, 100), 1.1 + 0.04 * i, 40.0, 40.0) for i in range(12)]
    log += [stamped(decode(2.0 + 0.03 * i, 300, 18.0, 132), 2.0 + 0.03 * i, 18.0, 20.0) for i in range(15)]
    report = timeline_report(log, min_steps=10)
    table = {(d["rows"], d["place"]): d for d in report["decode_predictions"]}
    assert set(table) == {("1024-1279", "partition, beside a prefill"), ("1024-1279", "partition, alone"),
                          ("256-511", "whole GPU, alone")}
    beside = table[("1024-1279", "partition, beside a prefill")]
    assert beside["steps"] == 20 and beside["gpu_over_predicted_p50"] == pytest.approx(1.1, rel=1e-3)
    assert table[("1024-1279", "partition, alone")]["steps"] == 12
    assert table[("1024-1279", "partition, alone")]["gpu_over_predicted_p50"] == pytest.approx(1.0, rel=1e-3)
    assert table[("256-511", "whole GPU, alone")]["gpu_over_predicted_p50"] == pytest.approx(0.9, rel=1e-3)
    assert "| 1024-1279 | partition, beside a prefill | 20 | 100 |" in markdown(report)


def test_a_log_without_gpu_stamps_has_no_decode_prediction_table():
    report = timeline_report(run_log())
    assert report["decode_predictions"] == [] and not report["gpu_stamps"]
    assert "| no GPU stamps in the log |" in markdown(report)
    with pytest.raises(ValueError, match="--rows-band must be > 0"):
        timeline_report(run_log(), rows_band=0)


def test_each_window_says_the_gpu_s_power_and_how_much_of_it_ran_capped():
    """From NVML's energy counter where the records carry it (joules over seconds), else the
    median of their power readings; none on a log without readings."""
    metered = [dict(decode(0.5 * i, 800, 45.0, 108), energy_j=1000.0 + 350.0 * i, power_w=999.0,
                    power_capped=i % 2 == 0) for i in range(20)]  # 700 W over 0-9.5 s
    read = [dict(decode(10.0 + 0.5 * i, 800, 45.0, 108), power_w=600.0 + i) for i in range(5)]
    report = timeline_report(metered + read + [decode(20.0, 300, 20.0, 132)])
    first, second, third = report["windows"]
    assert first["gpu_w"] == pytest.approx(700.0) and first["power_capped"] == pytest.approx(0.5)
    assert second["gpu_w"] == 602.0 and second["power_capped"] is None
    assert third["gpu_w"] is None and third["power_capped"] is None
    table = markdown(report)
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert rows["| 0"].endswith("| 700 (50%) |") and rows["| 10"].endswith("| 602 |") and rows["| 20"].endswith("| - |")


def test_fused_steps_show_beside_the_partitions_prefills_with_their_share_of_prompt_tokens():
    """A fused step's tokens are its rows plus its riders' prompt tokens; a log written before
    fused records named their prompts shows no share rather than a guess."""
    fused = {"t": 1.0, "phase": "fused", "batch": 300 + 2, "tokens": 300 + 1500, "prompts": 2, "measured_ms": 35.0,
             "prefill_sms": 0, "decode_sms": 132, "waiting": 0}
    log = [prefill(0.5, 2, 500, 60.0, 40, 92, 60.0), fused, dict(fused, t=2.0), decode(3.0, 300, 20.0, 132)]
    window = timeline_report(log, window_s=10.0)["windows"][0]
    assert (window["fused_steps"], window["fused_ms_p50"]) == (2, 35.0)
    assert window["prompt_tokens_fused"] == pytest.approx(3000 / 3500, abs=1e-3)
    assert "| 2 | 35 | 86% |" in markdown(timeline_report(log, window_s=10.0))
    older = [r if r["phase"] != "fused" else {k: v for k, v in r.items() if k != "prompts"} for r in log]
    assert timeline_report(older, window_s=10.0)["windows"][0]["prompt_tokens_fused"] is None
