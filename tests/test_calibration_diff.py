"""`bullet-trt bench calibrations`: two calibrations' predictions of the same steps, as the
scheduler reads them (the stored files: no GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.spatial.perf_model import ModelCost, PerfModel, PrefillShape
from bullet_trt.tools.bench import calibration_diff

DATA = Path(__file__).resolve().parents[1] / "docs/data"
BF16, W8A8 = DATA / "perf_model_h200_qwen3-30b-a3b.yaml", DATA / "perf_model_h200_qwen3-30b-a3b.fp8-w8a8.yaml"


def test_each_row_is_each_files_prediction_and_their_ratio(capsys):
    assert calibration_diff.main([str(BF16), str(W8A8), "--arch", "qwen3-30b-a3b", "--fp8-experts", "--json",
                                  "--decode", "640x600@132,640x600@68", "--prefill", "8x200@24"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["step"], r["sms"]) for r in rows] == [("decode", 132), ("decode", 68), ("prefill", 24)]
    cost = ModelCost.from_arch(ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"]), 2, True)
    old, new = (PerfModel.from_saved(yaml.safe_load(p.read_text()), cost) for p in (BF16, W8A8))
    assert rows[1]["old_ms"] == round(old.decode_ms(640, 640 * 600, 68), 3)
    assert rows[2]["new_ms"] == round(new.prefill_ms(PrefillShape.of([200] * 8), 24), 3)
    for r in rows:
        assert r["old_over_new"] == pytest.approx(r["old_ms"] / r["new_ms"], abs=2e-3)
    assert rows[0]["old_ms"] > rows[0]["new_ms"]  # FP8 experts and activations: a faster decode step


def test_a_shape_that_is_not_count_x_length_at_sms_is_refused(capsys):
    with pytest.raises(SystemExit):
        calibration_diff.main([str(BF16), str(W8A8), "--arch", "qwen3-30b-a3b", "--decode", "640@132"])
    assert "'640@132' is not COUNTxLENGTH@SMS" in capsys.readouterr().err
