"""What bullet's prefill ran near capacity, from an iteration log: the batches' token counts,
the SMs their time was spent on, and the performance model's error on them. Runs on a CPU.

    PYTHONPATH=. python docs/data/gpu_round_2026-11-25c/prefill_at_the_edge.py \
        docs/data/gpu_round_2026-11-25b/h100/iter_wait_false.jsonl.xz
"""
import json
import statistics
import sys

from bullet_trt.tools.bench.kept_files import open_kept

with open_kept(sys.argv[1], "rt") as f:
    prefills = [row for row in map(json.loads, f) if row["phase"] == "prefill"]
total_ms = sum(p["measured_ms"] for p in prefills)


def share_of_time(rows) -> str:
    return f"{sum(p['measured_ms'] for p in rows) / total_ms * 100:.1f}%"


print(f"{len(prefills)} prefills, {statistics.median(p['tokens'] for p in prefills):g} tokens at the median")
print("prefill time on 48 SMs or fewer:", share_of_time([p for p in prefills if p["sms"] <= 48]))
print("prefill time in batches of 512 tokens or fewer:", share_of_time([p for p in prefills if p["tokens"] <= 512]))
errors = [abs(p["predicted_ms"] / p["measured_ms"] - 1) for p in prefills]
print(f"median |predicted / measured - 1|: {statistics.median(errors) * 100:.1f}%")
