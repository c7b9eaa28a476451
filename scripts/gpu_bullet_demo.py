"""Bullet mode on a GPU: two MPS-client workers on green-context partitions serve a burst of
requests while the iteration log records the SM split per iteration.

    python scripts/gpu_bullet_demo.py ENGINE_DIR OUT_DIR [--mode bullet] [--requests 48]

Prints the splits that occurred and a summary of predicted vs measured iteration times.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

from bullet_trt.serving.llm import LLM
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("out")
    ap.add_argument("--mode", default="bullet")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (Poisson)")
    ap.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"iterations_{args.mode}.jsonl"
    log.unlink(missing_ok=True)
    overrides = {"serve.mode": args.mode, "serve.iteration_log": str(log)}
    overrides |= dict(kv.split("=", 1) for kv in args.set)
    rng = random.Random(0)
    t_load = time.monotonic()
    with LLM(args.engine, executor="serve", **overrides) as llm:
        core = llm.engine
        print(f"engine up in {time.monotonic() - t_load:.1f} s; partitions: "
              f"prefill {core.prefill.partitions.get('name')} decode {core.decode.partitions.get('name')}",
              flush=True)
        arrivals, t = [], 0.0
        for i in range(args.requests):
            t += rng.expovariate(args.rate)
            arrivals.append((t, i, rng.randint(200, 2000), rng.randint(32, 256)))
        start = time.monotonic()
        pending = collections.deque(arrivals)
        first_token, done = {}, {}
        while pending or core.has_unfinished():
            now = time.monotonic() - start
            while pending and pending[0][0] <= now:
                _, i, n_in, n_out = pending.popleft()
                ids = [rng.randint(1000, 30000) for _ in range(n_in)]
                core.add_request(NewRequest(f"r{i}", ids, SamplingParams(max_tokens=n_out, temperature=0,
                                                                         ignore_eos=True)))
            if not core.has_unfinished():
                time.sleep(0.001)
                continue
            for o in core.step():
                t_now = time.monotonic() - start
                first_token.setdefault(o.request_id, t_now)
                if o.finished:
                    done[o.request_id] = (t_now, o.num_output_tokens, o.finish_reason)
        elapsed = time.monotonic() - start
        stats = core.stats()
    recs = [json.loads(line) for line in open(log)]
    splits = collections.Counter((r["phase"], r["sms"]) for r in recs)
    err = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in recs if r["measured_ms"] > 0]
    ttft = [first_token[f"r{i}"] - a for a, i, _, _ in arrivals]
    summary = {
        "mode": args.mode, "requests": len(done), "elapsed_s": round(elapsed, 2),
        "output_tokens": sum(v[1] for v in done.values()),
        "iterations": len(recs), "distinct_prefill_splits": sorted({r["sms"] for r in recs if r["phase"] == "prefill"}),
        "distinct_decode_splits": sorted({r["sms"] for r in recs if r["phase"] == "decode"}),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "median_abs_pred_error_pct": round(100 * statistics.median(err), 1) if err else None,
        "kv_free_after": stats.kv_blocks_free, "kv_total": stats.kv_blocks_total,
    }
    print("iterations per (phase, SMs):", dict(sorted(splits.items())))
    print(json.dumps(summary))
    (out / f"summary_{args.mode}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
