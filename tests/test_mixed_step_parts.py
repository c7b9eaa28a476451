"""`bench mixed-step` sets each mixed step against its parts: the decode graph at its rows and
its chunk's prefill alone. Checked on a result of known times, the shape `measure` writes."""
from __future__ import annotations

import pytest

from bullet_trt.tools.bench.mixed_step import fused_against_parts, markdown


def step(chunk, rows, device_ms):
    return {"chunk": chunk, "decode_rows": rows, "eager_ms": 50.0, "graphed_ms": device_ms + 2,
            "eager_over_graphed": 1.5, "graphed_launch_ms": 10.0, "graphed_device_ms": device_ms,
            "graphed_TFLOPs": 100.0, "of_gemm_rate": 0.1}


def result(decode_graph):
    return {"gpu": "test", "ctx": 1250, "gemm_TFLOPs": 800.0, "overrides": {}, "decode_graph": decode_graph,
            "steps": [step(576, 0, 15.0), step(576, 224, 25.0), step(1792, 224, 43.0), step(576, 666, 38.0)]}


def test_each_mixed_step_against_the_decode_graph_and_its_prefill_alone():
    found = {(f["chunk"], f["decode_rows"]): f for f in fused_against_parts(
        result([{"decode_rows": 224, "bucket": 256, "graphed_ms": 19.0, "launch_ms": 3.0, "device_ms": 17.0}]))}
    assert set(found) == {(576, 224), (1792, 224)}  # 666 rows: no decode graph timed; no 0-row chunk: no parts
    riding = found[(576, 224)]
    assert riding["added_ms"] == pytest.approx(8.0)
    assert riding["riding_tok_per_ms"] == pytest.approx(72.0)
    assert riding["alone_tok_per_ms"] == pytest.approx(38.4)
    assert riding["over_parts"] == pytest.approx(25.0 / 32.0, abs=1e-3)
    unpaired = found[(1792, 224)]  # its chunk never ran alone
    assert "over_parts" not in unpaired and unpaired["riding_tok_per_ms"] == pytest.approx(1792 / 26.0, abs=0.1)


def test_a_mixed_step_no_slower_than_its_rows_gets_no_rate():
    found = fused_against_parts(result([{"decode_rows": 224, "bucket": 256, "graphed_ms": 30.0, "launch_ms": 3.0,
                                         "device_ms": 26.0}]))
    assert found[0]["riding_tok_per_ms"] is None and found[0]["added_ms"] == pytest.approx(-1.0)


def test_the_tables_show_the_decode_graph_and_the_parts():
    res = result([{"decode_rows": 224, "bucket": 256, "graphed_ms": 19.0, "launch_ms": 3.0, "device_ms": 17.0}])
    res["fused_against_parts"] = fused_against_parts(res)
    text = markdown(res)
    assert "| 224 | 256 | 19.0 | 3.0 | 17.0 |" in text
    assert "| 576 | 224 | 25.0 | 17.0 | 15.0 | 0.78x | 72.0 | 38.4 |" in text
    assert "| 1792 | 224 | 43.0 | 17.0 | - | - | 68.9 | - |" in text


def test_a_result_without_decode_graphs_still_prints():  # results written before decode graphs were timed
    res = result([])
    del res["decode_graph"]
    assert fused_against_parts(res) == [] and "fused against" not in markdown(res)
