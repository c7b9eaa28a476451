"""How a bullet server's decode steps split between those beside a prefill (held to the TPOT
plan) and those alone on the whole GPU, from an iteration log (`serve.iteration_log`), with
the performance model's error on each: how far the mean step, which is what a long request's
TPOT averages, sits from the per-step bound. A CPU reads it:

    python docs/data/gpu_round_2026-11-26e/steps_beside_prefill.py docs/data/gpu_round_2026-11-25b/h100/iter_wait_false.jsonl.xz
"""
from __future__ import annotations

import json
import lzma
import statistics
import sys


def main(path: str) -> None:
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if r["phase"] == "decode" and r.get("measured_ms")]
    prefills = [r for r in rows if r["phase"] == "prefill" and r.get("measured_ms")]
    span_s = max(r["t"] for r in rows) - min(r["t"] for r in rows)
    beside = [r for r in steps if r.get("prefill_in_flight")]
    alone = [r for r in steps if not r.get("prefill_in_flight")]
    print(f"{path}: {span_s:.0f} s, {len(steps)} decode steps, {len(prefills)} prefills "
          f"(prefill busy {sum(r['measured_ms'] for r in prefills) / 1e3 / span_s:.0%} of the time)")
    for name, group in (("beside a prefill", beside), ("alone", alone)):
        if not group:
            continue
        error = sorted(r["measured_ms"] / r["predicted_ms"] for r in group if r.get("predicted_ms"))
        print(f"  {name}: {len(group)} steps ({len(group) / len(steps):.0%}), measured mean "
              f"{statistics.mean(r['measured_ms'] for r in group):.1f} ms on {statistics.median(r['decode_sms'] for r in group):.0f} SMs "
              f"(median), measured / predicted p10 {error[len(error) // 10]:.2f}, p50 {error[len(error) // 2]:.2f}, "
              f"p90 {error[9 * len(error) // 10]:.2f}")
    print(f"  every step: mean {statistics.mean(r['measured_ms'] for r in steps):.1f} ms")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
