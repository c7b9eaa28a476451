"""The stored H100 performance model's prefill predictions against the prefill times that
prefill_by_sms.py measured (another machine session than the calibration's): where the
roofline's multiplicative fit misses the eager step's host floor. Runs on a CPU.

    PYTHONPATH=. python docs/data/gpu_round_2026-11-25c/model_vs_prefill_by_sms.py
"""
import json
import statistics
from pathlib import Path

import yaml

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.spatial.perf_model import ModelCost, PerfModel, PrefillShape

here = Path(__file__).parent
cost = ModelCost.from_arch(ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"], source="llama-3.1-8b"), 2)
model = PerfModel.from_saved(yaml.safe_load((here.parent / "perf_model_h100_llama-3.1-8b.yaml").read_text()), cost)
rows = json.loads((here / "h100" / "prefill_by_sms.json").read_text())["rows"]
errors: dict[int, list[float]] = {}
print("tokens  SMs  measured ms  predicted ms  error")
for r in rows:
    predicted = model.prefill_ms(PrefillShape.of([r["tokens"]]), r["sms"])
    error = predicted / r["ms"] - 1
    errors.setdefault(r["tokens"], []).append(error)
    print(f"{r['tokens']:6d} {r['sms']:4d} {r['ms']:12.1f} {predicted:13.1f} {error * 100:+6.0f}%")
for tokens, errs in errors.items():
    print(f"{tokens} tokens: median error {statistics.median(errs) * 100:+.0f}%, "
          f"from {min(errs) * 100:+.0f}% to {max(errs) * 100:+.0f}%")
