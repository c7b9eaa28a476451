"""Prefill step time at every green-partition size from 16 SMs up, in steps of 8: whether a
prefill's time falls smoothly with its SMs or in steps (GEMM tiles in whole waves), which
decides whether partition sizes that avoid wave quantization are a lever for the split.

    bash scripts/gpu_run.sh run python docs/data/gpu_round_2026-11-25c/prefill_by_sms.py
"""
import json
import os

import torch

from bullet_trt.spatial.calibrate import measurement_setup, profile_items, time_ms

engine = os.environ["ENGINE"]
counts = list(range(16, 129, 8))
_, state, session, streams = measurement_setup(engine, counts)
set_num_sms = getattr(session.model.ops, "set_num_sms", None)
rows = []
for sms, stream in sorted(streams.items()):
    if set_num_sms is not None:
        set_num_sms(sms)
    for tokens in (512, 1024, 2048):
        items = profile_items([tokens], False, state.block_size)
        ms = time_ms(lambda: session.run(items), stream, repeats=5)
        rows.append({"sms": sms, "tokens": tokens, "ms": round(ms, 3)})
        print(f"{sms:4d} SMs {tokens:5d} tokens {ms:8.2f} ms  {ms * sms:9.0f} SM-ms", flush=True)
out = {"gpu": torch.cuda.get_device_name(), "engine": os.path.basename(engine.rstrip("/")), "rows": rows}
with open(os.path.join(os.environ.get("OUT", "."), "prefill_by_sms.json"), "w") as f:
    json.dump(out, f, indent=1)
