"""Refits the performance model to the step times GPUs measured (the stored calibration
points, docs/data/perf_profile_*.json; for Qwen3-30B-A3B those of this round, whose prompts
repeated one token id: h200/perf_profile_h200_qwen3-30b-a3b_one_token.json) on their own
training / held-out split, and prints the median errors next to those the stored
calibrations reported. CPU only:

    PYTHONPATH=. python docs/data/gpu_round_2026-11-25e/refit_calibrations.py
"""
import json
from pathlib import Path

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.spatial.perf_model import ModelCost, ProfilePoint, fit, median_abs_pct_error

DATA = Path(__file__).resolve().parents[1]
PROFILES = [("qwen3-30b-a3b", "h200", Path(__file__).parent / "h200/perf_profile_h200_qwen3-30b-a3b_one_token.json"),
            ("llama-3.1-8b", "h100", DATA / "perf_profile_h100_llama-3.1-8b.json"),
            ("llama-3.1-8b", "h200", DATA / "perf_profile_h200_llama-3.1-8b.json")]

print("| model | GPU | stored: train / held-out median error | refit: train / held-out | refit coefficients |")
print("|---|---|---|---|---|")
for arch, gpu, path in PROFILES:
    data = json.loads(path.read_text())
    points = [ProfilePoint(**p) for p in data["points"]]
    held = set(data["held_out"])
    train = [p for i, p in enumerate(points) if i not in held]
    cost = ModelCost.from_arch(ModelArch.from_hf_dict(PRESETS[arch]), 2)
    model = fit(cost, data["report"]["total_sms"], train)
    c = model.coeffs
    rep = data["report"]
    print(f"| {arch} | {gpu} | {rep['train_median_abs_pct_error']:.1f}% / {rep['held_out_median_abs_pct_error']:.1f}% "
          f"| {median_abs_pct_error(model, train):.1f}% / {median_abs_pct_error(model, [points[i] for i in sorted(held)]):.1f}% "
          f"| peak {c.peak_tflops:.0f} TFLOP/s, bandwidth {c.bw_max_gbs:.0f} GB/s, floors {c.prefill_floor_ms:.1f} / "
          f"{c.decode_floor_ms:.1f} ms, experts {c.expert_tflops:.0f} TFLOP/s |")
