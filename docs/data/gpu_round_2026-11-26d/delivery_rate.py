"""How fast responses left the server in stored serving runs: per run, the streams in flight on
average, the responses a second the clients received, their ratio (how long a round over every
stream takes at that rate), each request's median interval between responses, and the tokens a
response carried. A CPU reads it:

    python docs/data/gpu_round_2026-11-26d/delivery_rate.py 'docs/data/gpu_round_2026-11-2*/**/*sharegpt*.json.xz'
"""
from __future__ import annotations

import glob
import json
import lzma
import statistics
import sys


def main(pattern: str) -> None:
    print("| run | rate (req/s) | streams in flight | responses/s | streams / responses a second (ms) "
          "| interval between responses, request p50 (ms) | tokens a response |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(pattern, recursive=True)):
        with lzma.open(path, "rt") as f:
            run = json.load(f)
        if run.get("kind") != "bullet_trt.serve_bench":
            continue
        done = [r for r in run["requests"] if r.get("finished") and r.get("num_chunks")]
        if not done:
            continue
        span = run["summary"]["duration_s"]
        streams = sum(r["e2e_s"] for r in done) / span
        responses = sum(r["num_chunks"] for r in done)
        long_ones = [r for r in done if r["num_chunks"] > 20]
        interval = statistics.median((r["e2e_s"] - r["ttft_s"]) / (r["num_chunks"] - 1) for r in long_ones) \
            if long_ones else float("nan")
        tokens = sum(r["num_output_tokens"] for r in done) / responses
        print(f"| {path} | {run['rate']:g} | {streams:.0f} | {responses / span:.0f} | "
              f"{streams / (responses / span) * 1e3:.0f} | {interval * 1e3:.0f} | {tokens:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
