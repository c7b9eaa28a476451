"""`bullet-trt bench tp`: what tensor parallelism costs a decode step, on a machine of N GPUs.

    bullet-trt bench tp --engine-dir engines/llama-3.1-8b --tp 2 [--batches 1,16,64] [--ctx 512] [--json out.json]

1. The all-reduce alone: N processes (rank r on cuda:r, NCCL, NVLink multicast off) sum a
   (rows, hidden) tensor of the model's dtype, for the rows of a decode step and of a prefill,
   timed with CUDA events; its bus bandwidth (NCCL's convention, 2(N-1)/N x bytes / time)
   against the link's.
2. The engine's decode step: the chunked engine at TP=1 (decode CUDA graphs, and eager) and
   at TP=N (eager, and with its graphs capturing the collectives: `parallel.decode_graphs`),
   `batch` sequences of `ctx` tokens decoding together, the median of the steps where all of
   them decode.
3. Per step, the collectives' share: 2 all-reduces a layer and one for the embedding at the
   batch's rows, from (1), against the step's time from (2).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bullet_trt.engine.tp_group import Rendezvous, TPGroup, rank_device
from bullet_trt.tools.bench.json_output import write_json

ROWS = (1, 8, 16, 32, 64, 128, 256, 1024, 4096)


def _all_reduce_rank(rank: int, rendezvous: Rendezvous, hidden: int, dtype: torch.dtype, rows: list[int],
                     repeats: int, out) -> None:
    import torch.distributed as dist

    group = TPGroup.join(rendezvous, rank, rank_device("cuda", rank))
    try:
        for n in rows:
            t = torch.randn(n, hidden, device=group.device, dtype=dtype)
            for _ in range(5):  # NCCL's first calls set up its channels
                dist.all_reduce(t)
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                dist.barrier(group=group.control)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(t)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            if rank == 0:
                out.put((n, statistics.median(times)))
    finally:
        group.close()


def all_reduce_times(tp: int, hidden: int, dtype: torch.dtype, rows: list[int], repeats: int = 50) -> dict[int, float]:
    """{rows: median ms of one all-reduce of (rows, hidden)} over ``tp`` GPUs."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = Rendezvous.new(tp)
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, rendezvous, hidden, dtype, rows, repeats, out))
             for r in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"bullet-trt bench tp: an all-reduce rank failed (exit codes {[p.exitcode for p in procs]})")
    return dict(out.get() for _ in rows)


def decode_step_ms(engine_dir: str, batch: int, ctx: int, overrides: dict) -> float:
    """Median time of the chunked engine's steps while all ``batch`` sequences decode."""
    from bullet_trt import LLM, SamplingParams
    from bullet_trt.engine.request import NewRequest

    decode_steps = 24
    with LLM(engine_dir, **{"serve.mode": "chunked", "serve.chunk_size": max(ctx, 512), **overrides}) as llm:
        core = llm.engine
        for i in range(batch):
            ids = [(7 * i + j) % 1000 + 3 for j in range(ctx)]
            core.add_request(NewRequest(f"b{i}", ids, SamplingParams(max_tokens=decode_steps + 8, temperature=0,
                                                                     ignore_eos=True)))
        started: set[str] = set()
        while len(started) < batch:  # prefills, until every sequence has its first token
            started.update(out.request_id for out in core.step() if out.new_token_ids)
        times = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            core.step()
            times.append((time.perf_counter() - start) * 1e3)
        while core.has_unfinished():
            core.step()
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--tp", type=int, default=2, help="GPUs (default 2)")
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens each decoding sequence holds (default 512)")
    ap.add_argument("--link-gbs", type=float, default=0.0,
                    help="the GPUs' link bandwidth per direction in GB/s, to compare against (e.g. 450 for "
                         "H100/H200 NVLink 4); 0: not compared")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bullet-trt bench tp: --tp {args.tp} needs {args.tp} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    from bullet_trt.config import load_engine_config
    from bullet_trt.model.arch import ModelArch
    from bullet_trt.model.loader import resolve_dtype

    cfg = load_engine_config(args.engine_dir)
    arch = ModelArch.from_checkpoint(cfg.checkpoint_path)
    dtype = resolve_dtype(arch, cfg.dtype, "cuda")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    rows = sorted(set(ROWS) | set(batches))
    ar = all_reduce_times(args.tp, arch.hidden_size, dtype, rows)
    elem = torch.empty((), dtype=dtype).element_size()
    result = {"engine_dir": str(Path(args.engine_dir).resolve()), "tp": args.tp, "ctx": args.ctx,
              "device": torch.cuda.get_device_name(0), "dtype": str(dtype), "hidden": arch.hidden_size,
              "link_gbs": args.link_gbs or None, "all_reduce": [], "decode": []}
    print(f"all-reduce over {args.tp} GPUs, (rows, {arch.hidden_size}) {dtype}")
    print("| rows | ms | bus GB/s |" + (" of link |" if args.link_gbs else ""))
    for n in rows:
        bus = 2 * (args.tp - 1) / args.tp * n * arch.hidden_size * elem / ar[n] / 1e6
        result["all_reduce"].append({"rows": n, "ms": ar[n], "bus_gbs": bus})
        print(f"| {n} | {ar[n]:.4f} | {bus:.1f} |" + (f" {bus / args.link_gbs:.0%} |" if args.link_gbs else ""))
    per_step = 2 * arch.num_layers + 1
    print(f"\ndecode step at {args.ctx} tokens a sequence ({per_step} all-reduces a step at TP={args.tp})")
    print(f"| batch | TP=1 graphs ms | TP=1 eager ms | TP={args.tp} eager ms | TP={args.tp} graphs ms "
          f"| all-reduces ms | their share of the graphed step |")
    tp = {"parallel.tensor_parallel_size": args.tp}
    for b in batches:
        one = decode_step_ms(args.engine_dir, b, args.ctx, {})
        eager = decode_step_ms(args.engine_dir, b, args.ctx, {"decode.cuda_graph_batch_sizes": "[]"})
        many = decode_step_ms(args.engine_dir, b, args.ctx, tp)
        many_graphs = decode_step_ms(args.engine_dir, b, args.ctx, {**tp, "parallel.decode_graphs": True})
        comm = per_step * ar[b]
        result["decode"].append({"batch": b, "tp1_graphs_ms": one, "tp1_eager_ms": eager, "tp_ms": many,
                                 "tp_graphs_ms": many_graphs, "all_reduce_ms": comm})
        print(f"| {b} | {one:.2f} | {eager:.2f} | {many:.2f} | {many_graphs:.2f} | {comm:.2f} "
              f"| {comm / many_graphs:.0%} |")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
