"""Where a chunked-prefill step's wall time goes at a large decode batch: scheduling, building
the batch items, the session's run (metadata, launches, the forward, sampling's sync) and
accepting the tokens, for decode-only steps (CUDA graphs) and mixed steps (eager, prompt
chunks beside the decode rows), then the hottest Python functions of mixed steps.
(A profiler's kernel-time sum was tried for the GPU's share and dropped: for mixed steps it
reported less time than their GEMMs need at the measured GEMM rate.)

    python scripts/gpu_step_breakdown.py /tmp/engines/llama-3.1-8b --batches 256,512,1024
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from bullet_trt.config import load_engine_config
from bullet_trt.engine.core import create_engine
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams

GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]


def add(engine, rng: random.Random, n: int, prompt_len: int, tag: str) -> None:
    vocab = engine.state.arch.vocab_size
    for i in range(n):
        params = SamplingParams(max_tokens=3000, min_tokens=3000, temperature=0.0, ignore_eos=True)
        engine.add_request(NewRequest(f"{tag}{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params))


def timed_step(engine) -> dict:
    """EngineCore.step with a clock between its phases (the same calls, in the same order)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan = engine.scheduler.schedule()
    t1 = time.perf_counter()
    pre_items = [engine._item(c) for c in plan.prefills]
    dec_items = [engine._item(c) for c in plan.decodes]
    t2 = time.perf_counter()
    pre_res, dec_res = engine.executor.run(pre_items, dec_items)
    t3 = time.perf_counter()
    for chunk, res in list(zip(plan.prefills, pre_res)) + list(zip(plan.decodes, dec_res)):
        seq = chunk.seq
        seq.num_cached_tokens += chunk.num_new_tokens
        if res is not None:
            engine._accept(seq, res)
            engine._output(seq)
    t4 = time.perf_counter()
    return {"decodes": len(plan.decodes), "prefill_tokens": sum(c.num_new_tokens for c in plan.prefills),
            "schedule_ms": (t1 - t0) * 1e3, "items_ms": (t2 - t1) * 1e3, "run_ms": (t3 - t2) * 1e3,
            "accept_ms": (t4 - t3) * 1e3, "wall_ms": (t4 - t0) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine_dir")
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--prompt-len", type=int, default=500, help="context of the decoding rows")
    ap.add_argument("--new-prompt-len", type=int, default=160, help="prompts arriving during the measured steps")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    rng = random.Random(0)
    for batch in [int(x) for x in args.batches.split(",")]:
        cfg = load_engine_config(args.engine_dir, {
            "serve.mode": "chunked", "serve.chunk_size": 2048, "decode.max_num_seqs": max(batch + 64, 256),
            "decode.cuda_graph_batch_sizes": [s for s in GRAPH_SIZES if s <= max(batch, 256)]})
        engine = create_engine(cfg)
        add(engine, rng, batch, args.prompt_len, "d")
        while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        for mixed in (False, True):
            rows = []
            for i in range(args.steps):
                if mixed:
                    add(engine, rng, 8, args.new_prompt_len, f"m{batch}_{i}_")
                rows.append(timed_step(engine))
            rows = rows[2:]
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
            print(f"batch {batch} {'mixed' if mixed else 'decode-only'}: "
                  + " ".join(f"{k}={v:.1f}" for k, v in mean.items()), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.steps):
            add(engine, rng, 8, args.new_prompt_len, f"p{batch}_{i}_")
            engine.step()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(f"batch {batch} mixed, {args.steps} steps, hottest functions by own time:")
        print("\n".join(buf.getvalue().splitlines()[4:32]), flush=True)
        engine.close()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
