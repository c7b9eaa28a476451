"""Calibrates the performance model on the target GPU (``build_engines.py --profile``).

Times real engine steps (prefill of packed prompts, decode steps over paged contexts) on
green-context partitions of several SM counts, fits the roofline coefficients on 70% of the
points and reports the median absolute error on the held-out 30%. Writes
perf_model.<gpu>.yaml (coefficients, errors) and perf_profile.<gpu>.json (every point) into
the engine directory, named for the GPU measured (bullet_trt/spatial/calibration_store.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bullet_trt.config import load_engine_config
from bullet_trt.engine.kv_pool import fill_random
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem, TorchSession
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.spatial.calibration_store import CalibrationKey
from bullet_trt.spatial.step_code import step_code
from bullet_trt.spatial.perf_model import ModelCost, PrefillShape, ProfilePoint, fit, median_abs_pct_error
from bullet_trt.spatial.session_worker import worker_profiles

PREFILL_TOKENS = (128, 512, 1024, 2048, 4096)
# (batch, context per sequence). Serving decodes up to the decode profile's max_num_seqs rows,
# and past a few hundred rows the GEMMs turn compute-bound while attention stays bound by the
# KV stream: the fit must see such steps, or it extrapolates from memory-bound ones (on an
# H200, the model fitted up to 64 rows predicted 1024-row steps at 53-65% of their measured
# time). Shapes larger than the profile or the pool are skipped.
DECODE_SHAPES = ((1, 512), (8, 1024), (16, 4096), (32, 512), (32, 2048), (48, 1024), (64, 1024), (64, 3072),
                 (128, 1024), (256, 512), (256, 1536), (512, 256), (512, 768), (1024, 256), (1024, 512))


def time_ms(fn, stream, repeats: int = 3) -> float:
    with torch.cuda.stream(stream):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_tokens(count: int, vocab_size: int, seed: int) -> list[int]:
    """Token ids drawn at random, the same for the same seed. Not one id repeated: a prompt of
    one token throughout has the same hidden state at every position, so a mixture-of-experts
    layer routes all of it to the same k experts, a step no real prompt makes (the MoE
    calibration of 2026-11-25 timed such steps)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=gen).tolist()


def profile_items(lengths: list[int], decode: bool, block_size: int, vocab_size: int) -> list[BatchItem]:
    """One sequence per length on blocks of its own: a prompt of that many tokens (`decode`
    false), or one token after that many cached ones (true)."""
    items, next_block = [], 0
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tokens = profile_tokens(len(lengths) if decode else sum(lengths), vocab_size, seed=0)
    for n in lengths:
        blocks = -(-n // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        if decode:
            items.append(BatchItem("d", [tokens.pop()], n - 1, table, params, True, output_index=1))
        else:
            prompt, tokens = tokens[:n], tokens[n:]
            items.append(BatchItem("p", prompt, 0, table, params, True))
    return items


def measure(session: TorchSession, streams: dict[int, torch.cuda.Stream], block_size: int,
            max_len: int, pool_blocks: int, max_batch: int) -> list[ProfilePoint]:
    prefills = [t for t in PREFILL_TOKENS if t <= max_len and -(-t // block_size) <= pool_blocks]
    decodes = [(b, c) for b, c in DECODE_SHAPES
               if b <= max_batch and c <= max_len and b * -(-c // block_size) <= pool_blocks]
    points, vocab = [], session.model.arch.vocab_size
    set_num_sms = getattr(session.model.ops, "set_num_sms", None)
    bar = tqdm(total=len(streams) * (len(prefills) + len(decodes)), desc="calibrating", unit="step shape",
               file=sys.stderr, dynamic_ncols=True)
    for sms, stream in sorted(streams.items()):
        if set_num_sms is not None:  # kernels and cuBLASLt plan for the partition, as in the workers
            set_num_sms(sms)
        bar.set_postfix_str(f"{sms} SMs")
        for tokens in prefills:
            items = profile_items([tokens], False, block_size, vocab)
            ms = time_ms(lambda: session.run(items), stream)
            shape = PrefillShape.of([tokens])
            points.append(ProfilePoint("prefill", sms, ms, num_tokens=tokens, attn_pairs=shape.attn_pairs))
            bar.update()
        for batch, ctx in decodes:
            items = profile_items([ctx] * batch, True, block_size, vocab)
            ms = time_ms(lambda: session.run(items), stream)
            points.append(ProfilePoint("decode", sms, ms, batch=batch, total_ctx=batch * ctx))
            bar.update()
    bar.close()
    if set_num_sms is not None:
        set_num_sms(None)
    return points


def measurement_setup(engine_dir: str | Path, sm_counts, overrides: dict | None = None):
    """(cfg, state, session, {SM count: stream}) for timing the engine on green partitions:
    random data in the pool (not zeros), prefill as the prefill worker runs it, decode steps
    from the decode profile's graphs, and the whole GPU under its own SM count."""
    from bullet_trt.spatial.partitioners import make_partitioner

    if not torch.cuda.is_available():
        raise RuntimeError("measuring the engine needs a CUDA GPU")
    cfg = load_engine_config(engine_dir, overrides)
    state, model = build_shared_state(cfg, share=False)
    fill_random(state.kv_pool)
    # prefill as the prefill worker runs it (eager, or its piecewise graphs), decode from the
    # decode profile's graphs
    profile = dataclasses.replace(worker_profiles(cfg)["prefill"], cuda_graph_batch_sizes=cfg.decode.cuda_graph_batch_sizes)
    session = TorchSession(model, state.kv_pool, state.block_size, profile)
    part = make_partitioner("green", state.kv_pool.device)
    counts = [c for c in sm_counts if c < part.total_sms]
    part.prepare("prefill", counts)
    streams = {c: part.stream(c) for c in counts}
    streams[part.total_sms] = torch.cuda.current_stream()
    session.partitioner = part  # the streams live as long as their green contexts
    return cfg, state, session, streams


def calibrate_engine_dir(engine_dir: str | Path, sm_counts: tuple[int, ...] = (32, 64, 96),
                         seed: int = 0, overrides: dict | None = None) -> dict:
    """`overrides`: the engine configuration the server will run with (its decode profile
    bounds the decode batches measured)."""
    cfg, state, session, streams = measurement_setup(engine_dir, sm_counts, overrides)
    total = max(streams)
    gpu = torch.cuda.get_device_name()
    print(f"calibrating on {gpu} ({total} SMs) at {sorted(streams)} SMs", file=sys.stderr, flush=True)
    points = measure(session, streams, state.block_size, cfg.max_model_len, state.num_blocks,
                     cfg.decode.max_num_seqs)
    rng = random.Random(seed)
    shuffled = points[:]
    rng.shuffle(shuffled)
    cut = int(len(shuffled) * 0.7)
    train, held_out = shuffled[:cut], shuffled[cut:]
    cost = ModelCost.of_state(state)
    model_fit = fit(cost, total, train)
    key = CalibrationKey.for_server(cfg, state.arch, gpu, total, state.dtype)
    report = {"gpu": gpu, "total_sms": total, "points": len(points),
              "prefill_graph_tokens": list(session.piecewise.buckets) if session.piecewise else [],
              **({"moe_tiles": key.moe_tiles} if key.moe_tiles else {}),
              "step_code": step_code(),
              "train_median_abs_pct_error": round(median_abs_pct_error(model_fit, train), 2),
              "held_out_median_abs_pct_error": round(median_abs_pct_error(model_fit, held_out), 2)}
    model_fit.save(key.file(engine_dir), extra={"calibration": report})
    key.profile(engine_dir).write_text(json.dumps(
        {"report": report, "points": [vars(p) for p in points],
         "held_out": [points.index(p) for p in held_out]}, indent=1))
    print(json.dumps(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """A separate process, so that the measurement's memory and CUDA context are gone before
    a server loads the model (bullet_trt/serving/calibrate_on_start.py)."""
    ap = argparse.ArgumentParser(prog="python -m bullet_trt.spatial.calibrate", description=__doc__)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--overrides", default="{}",
                    help="JSON object of dotted configuration keys the server will run with")
    args = ap.parse_args(argv)
    calibrate_engine_dir(args.engine_dir, overrides=json.loads(args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
