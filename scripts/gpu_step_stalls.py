"""Finds long engine steps of the in-process (chunked) engine under a ShareGPT-like Poisson
load, and what they coincide with: Triton compiles, caching-allocator retries, cyclic
garbage collections. Prints every step over --slow-ms with its batch shape.

    python scripts/gpu_step_stalls.py /tmp/engines/llama-3.1-8b [--rate 46 --duration 8]
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from bullet_trt.tools.bench.datasets import poisson_arrivals, sample_lengths
from bullet_trt.config import load_engine_config
from bullet_trt.engine.core import create_engine
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams


def compiled_kernels() -> dict[str, set]:
    """Compiled variants per Triton kernel of the engine (their specialization keys)."""
    from bullet_trt.kernels import triton_ops
    out = {}
    for name, obj in vars(triton_ops).items():
        caches = getattr(obj, "device_caches", None)
        if isinstance(caches, dict):
            keys = set()
            for v in caches.values():
                table = v[0] if isinstance(v, tuple) else v
                if isinstance(table, dict):
                    keys |= {str(k) for k in table}
            out[name] = keys
    return out


def new_variants(before: dict[str, set], after: dict[str, set]) -> list[str]:
    return [f"{name}: {sorted(after[name] - before.get(name, set()))}" for name in after
            if after[name] - before.get(name, set())]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine_dir")
    ap.add_argument("--rate", type=float, default=46)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--slow-ms", type=float, default=150)
    args = ap.parse_args()
    cfg = load_engine_config(args.engine_dir, {
        "serve.mode": "chunked", "serve.chunk_size": 2048, "decode.max_num_seqs": 256,
        "decode.cuda_graph_batch_sizes": [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256]})
    core = create_engine(cfg)
    gc_pauses = []
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif info["generation"] == 2:
            gc_pauses.append((time.perf_counter() - started["t"]) * 1e3)
    gc.callbacks.append(on_gc)
    for burst in range(2):
        n = int(args.rate * args.duration)
        ins, outs = sample_lengths("sharegpt", n, seed=burst, max_model_len=cfg.max_model_len)
        at = poisson_arrivals(n, args.rate, seed=burst)
        t0 = time.monotonic()
        i = 0
        slow = []
        steps = 0
        while i < n or core.has_unfinished():
            now = time.monotonic() - t0
            while i < n and at[i] <= now:
                core.add_request(NewRequest(f"b{burst}-{i}", [5] * int(ins[i]),
                                            SamplingParams(max_tokens=int(outs[i]), temperature=0, ignore_eos=True)))
                i += 1
            if not core.has_unfinished():
                time.sleep(0.001)
                continue
            k0, r0, g0 = compiled_kernels(), torch.cuda.memory_stats().get("num_alloc_retries", 0), len(gc_pauses)
            running = len(core.scheduler.running)
            waiting = len(core.scheduler.waiting)
            s = time.perf_counter()
            core.step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - s) * 1e3
            steps += 1
            if ms > args.slow_ms:
                slow.append(f"  t={now:6.2f}s step {ms:6.0f} ms running {running} waiting {waiting}; new kernels "
                            f"{new_variants(k0, compiled_kernels())}, alloc retries "
                            f"{torch.cuda.memory_stats().get('num_alloc_retries', 0) - r0}, gen-2 gc "
                            f"{[round(p) for p in gc_pauses[g0:]]}")
        print(f"burst {burst}: {n} requests, {steps} steps, {len(slow)} over {args.slow_ms} ms", flush=True)
        print("\n".join(slow[:30]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
