"""serve.calibrate=auto on a GPU: a server whose engine directory has no calibration for the
GPU measures it once, stores perf_model.<gpu>.yaml, and takes it; a second start measures
nothing. A small random checkpoint keeps the measurement short."""
from __future__ import annotations

import torch
import yaml

from bullet_trt.config import load_engine_config
from bullet_trt.serving.calibrate_on_start import ensure_calibrated, needs_calibration
from bullet_trt.spatial.calibration_store import CalibrationKey, calibration_file, find_calibration
from bullet_trt.tools.build import build_from_checkpoint
from tests.checkpoints import make_variant


def test_a_server_calibrates_an_uncalibrated_gpu_once_and_then_uses_it(tmp_path):
    engine = build_from_checkpoint(make_variant(tmp_path / "ckpt", "llama"), tmp_path / "engine",
                                   max_model_len=512, dtype="bfloat16")
    cfg = load_engine_config(engine, {"device": "cuda", "kv.gpu_memory_fraction": "0.3"})
    gpu, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count
    assert needs_calibration(cfg) is not None
    ensure_calibrated(cfg)
    stored = calibration_file(engine, gpu)
    report = yaml.safe_load(stored.read_text())["calibration"]
    assert report["gpu"] == gpu and report["total_sms"] == sms and report["points"] > 20
    assert find_calibration(engine, CalibrationKey(gpu, sms)).path == stored
    written = stored.stat().st_mtime_ns
    assert needs_calibration(cfg) is None
    ensure_calibrated(cfg)
    assert stored.stat().st_mtime_ns == written
