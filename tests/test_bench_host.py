"""The host fields a serving run's result carries (tools/bench/host.py)."""
from __future__ import annotations

from bullet_trt.tools.bench.host import cpu_model, host_fields, python_pace_ns


def test_cpu_model_reads_the_first_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\n\nprocessor\t: 1\nmodel name\t: Other\n")
    assert cpu_model(info) == "Example CPU @ 2.0GHz"


def test_cpu_model_without_cpuinfo_falls_back_to_the_platform(tmp_path):
    assert cpu_model(tmp_path / "missing") != ""


def test_python_pace_is_a_time_per_item():
    pace = python_pace_ns(rounds=2, items=2_000)
    assert 0 < pace < 1e6  # nanoseconds per item, not per loop


def test_host_fields_name_cores_and_pace():
    host = host_fields()["host"]
    assert set(host) == {"cpu", "usable_cores", "cores", "python_pace_ns"}
    assert 1 <= host["usable_cores"] <= host["cores"]
    assert host["python_pace_ns"] > 0
