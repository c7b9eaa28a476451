"""`bullet-trt bench mixed-step`: chunked mode's mixed step, eager against piecewise CUDA graphs.

    bullet-trt bench mixed-step --engine-dir engines/llama-3.1-8b [--chunks 512,1024,2048]
        [--decode-rows 0,64,256,512] [--ctx 512] [--repeated-tokens] [--profile] [--host-profile]
        [--set KEY=VALUE ...] [--json out.json]

A mixed step is what chunked prefill runs while prompts wait: a chunk of one prompt's tokens
and one token for each decoding sequence, in one forward. Timed on the whole GPU with CUDA
events (median of repeats, after a warm-up), as the chunked engine runs it: eager, and with
piecewise graphs (engine/piecewise_graphs.py) whose token bucket is the step's size. The
decode rows attend to `ctx` cached tokens each; the chunk starts a fresh prompt. The ratio
eager / graphed is what the graphs save chunked mode per step; the FLOP rate of the graphed
step is against the GEMM rate measured in the same run. With no decode rows the step is a
prefill, as bullet's prefill worker runs it (eager unless it has pieces).

Token ids are random (a mixture-of-experts model routes them as it would real text);
--repeated-tokens also times each step with one id repeated, the steps the calibrations of
2026-11-25 and earlier timed. --profile prints the GPU kernels of the first step, eager, by
their total time, and their sum: a step whose kernels fill a small share of its eager time
(eager_ms) is bound by the host issuing them. The profile's own wall time includes the
profiler's overhead (on an H100, 41.6 ms for a 15.8 ms step).

Each step's times are from events around a launch and its wait, so they hold whatever the GPU
idled while the host issued the step. Its host launch time is timed apart (graphed_launch_ms:
the median time to queue the graphed step on an idle device, without waiting for it, as a
serving engine launches steps one ahead): near graphed_ms, the host sets the step's pace, and a
serving loop launching ahead cannot hide it. (In serving, chunked's mixed steps of 256-511 rows
logged a 24.4 ms launch against 29.7 ms on an H200 at 40 req/s, seventeenth round: this tells
how much of that is the host's own work.) graphed_device_ms is the graphed step with the host
out of it: the device first spins for longer than the host takes to queue the step, so its
pieces and attention calls are all queued before the first runs, and events around them time
the GPU's own work. --host-profile says where that launch time goes:
each step's graphed launch once more under the profiler, its host-side events (CUDA runtime
and driver calls, torch ops) by their own time, so a launch that waits for the device (an
allocation, a synchronizing copy) stands apart from many short kernel launches.

Beside them, for each decode row count, the step a decode worker runs when no prompt rides along:
its full CUDA graph (the bucket the engine config's decode batch sizes give), timed the same ways
(decode_graph). A fused step (`serve.fuse_prefill`) is a mixed step run by the decode worker, so
"fused against its parts" sets each mixed step's device time against the decode graph at its rows
plus the prefill of its chunk alone (where --decode-rows has 0), and the prompt tokens a millisecond
it adds over the decode graph against those of the prefill alone: whether a prompt rides in
decode's step cheaper than it runs apart, on the device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from bullet_trt.config import load_engine_config, parse_overrides
from bullet_trt.engine.kv_pool import fill_random
from bullet_trt.engine.piecewise_graphs import PiecewiseGraphs
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem, TorchSession
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.spatial.calibrate import profile_tokens, time_ms
from bullet_trt.spatial.perf_model import ModelCost
from bullet_trt.tools.bench.kernel_bench import gemm_tflops
from bullet_trt.tools.bench.json_output import write_json


def mixed_items(chunk: int, decode_rows: int, ctx: int, block_size: int, vocab_size: int,
                repeated: bool = False) -> list[BatchItem]:
    """A chunk of a new prompt, then decode_rows sequences of ctx cached tokens, each on its own
    blocks (the cache holds random data: attention reads it all the same)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    blocks = -(-(ctx + 1) // block_size)
    chunk_blocks = -(-chunk // block_size)
    tokens = [7] * (chunk + decode_rows) if repeated else profile_tokens(chunk + decode_rows, vocab_size, seed=0)
    items = [BatchItem("chunk", tokens[:chunk], 0, list(range(chunk_blocks)), params, True)] if chunk else []
    for r in range(decode_rows):
        first = chunk_blocks + r * blocks
        items.append(BatchItem(f"d{r}", [tokens[chunk + r]], ctx, list(range(first, first + blocks)), params,
                               True, output_index=1))
    return items


def kernel_profile(run, stream, top: int = 15) -> dict:
    """The GPU kernels of one call of `run` by total time, and its wall time (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.cuda.stream(stream):
        run()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    return {"wall_ms": round(wall_ms, 2), "kernel_ms": round(busy_ms, 2),
            "kernels": [{"name": e.key[:90], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 3)}
                        for e in kernels[:top]]}


LAUNCH_WINDOW = "bench.launch"


def host_profile(launch, stream, top: int = 15) -> dict:
    """Where the host's time goes while `launch()` queues a step on an idle device: the
    profiler's host-side events inside the launch (CUDA runtime and driver calls, torch ops)
    by their own time, and the launch's own time outside all of them (Python). A launch that
    waits for the device (an allocation through cudaMalloc, a synchronizing copy) shows it
    here as one call's time, where kernel launches are many short ones. Only the launch's
    window counts: the profiler's own synchronize when it stops would otherwise read as the
    biggest event (a first profile of the MoE's 2048 + 512 step listed it at 51 ms). The profiler's overhead is
    inside `profiled_ms`; the shares are what it tells."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with torch.cuda.stream(stream):
        launch().results()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            with record_function(LAUNCH_WINDOW):
                flight = launch()
            profiled_ms = (time.perf_counter() - start) * 1e3
        flight.results()
    return {"profiled_ms": round(profiled_ms, 2), **window_events(prof.events(), LAUNCH_WINDOW, top)}


def window_events(events, window: str, top: int) -> dict:
    """The host events inside the profiler's `window` range, summed by name (their own time), and
    the window's own time outside every one of them."""
    from torch.autograd import DeviceType

    window_event = next(e for e in events if e.name == window)
    span = window_event.time_range
    by_name: dict[str, list[float]] = {}
    for e in events:
        inside = span.start <= e.time_range.start and e.time_range.end <= span.end
        if e.name != window and inside and e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            calls_ms = by_name.setdefault(e.name[:90], [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += e.self_cpu_time_total / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    own = window_event.self_cpu_time_total / 1e3
    return {"events_ms": round(sum(ms for _, ms in by_name.values()), 2), "outside_events_ms": round(own, 2),
            "events": [{"name": name, "calls": calls, "self_ms": round(ms, 3)} for name, (calls, ms) in ranked[:top]]}


def host_launch_ms(launch, stream, repeats: int = 10) -> float:
    """Median host milliseconds of `launch()` queuing a step (a StepInFlight) on an idle device,
    without waiting for it; each step's results are taken before the next launch, so no launch
    waits behind another's work in the device's queue."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats + 1):  # the first warms
            torch.cuda.synchronize()
            start = time.perf_counter()
            flight = launch()
            times.append((time.perf_counter() - start) * 1e3)
            flight.results()
    return statistics.median(times[1:])


def device_ms(launch, stream, host_ms: float, repeats: int = 5) -> float:
    """Median GPU milliseconds of the step `launch()` queues, without the host's pace: a spin
    kernel holds the stream for several times the host's launch time (`host_ms`) while the
    host queues the step behind it, so no piece waits for its launch. The spin counts clock
    cycles; at a clock below 2 GHz it lasts longer, which only widens the margin."""
    spin_cycles = int((3 * host_ms + 20) * 2e6)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats + 1):  # the first warms
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(spin_cycles)
            start.record(stream)
            flight = launch()
            end.record(stream)
            flight.results()
            times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def step_flops(cost: ModelCost, chunk: int, decode_rows: int, ctx: int) -> float:
    """Dense FLOPs of the step's tokens and their attention (the chunk's causal half)."""
    pairs = chunk * (chunk + 1) / 2 + decode_rows * (ctx + 1)
    return cost.flops_per_token * (chunk + decode_rows) + cost.attn_flops_per_pair * pairs


def measure(engine_dir: str, chunks: list[int], decode_rows: list[int], ctx: int, repeated: bool = False,
            profile_first: bool = False, profile_host: bool = False, overrides: dict | None = None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bullet-trt bench mixed-step needs a CUDA GPU")
    steps = [(c, d) for c in chunks for d in decode_rows if c + d > 0]
    buckets = sorted({c + d for c, d in steps})
    cfg = load_engine_config(engine_dir, {**(overrides or {}), "device": "cuda"})
    state, model = build_shared_state(cfg, share=False)
    fill_random(state.kv_pool)
    vocab = state.arch.vocab_size
    need = max(max(b for it in mixed_items(c, d, ctx, state.block_size, vocab) for b in it.block_table) + 1
               for c, d in steps)
    if need > state.num_blocks:
        raise SystemExit(f"the largest step needs {need} KV blocks, the pool has {state.num_blocks}: "
                         "lower --decode-rows or --ctx")
    session = TorchSession(model, state.kv_pool, state.block_size, cfg.prefill, use_cuda_graphs=False)
    session.warm_up()
    graphs = PiecewiseGraphs(model, state.kv_pool, buckets)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graphs.capture_all()
    cost = ModelCost.of_state(state)
    rate = gemm_tflops(stream)

    def eager_and_graphed(items: list[BatchItem]) -> tuple[float, float]:
        session.piecewise = None
        eager = time_ms(lambda: session.run(items), stream, repeats=10)
        session.piecewise = graphs
        return eager, time_ms(lambda: session.run(items), stream, repeats=10)

    rows, profiled = [], None
    for chunk, decode in steps:
        items = mixed_items(chunk, decode, ctx, state.block_size, vocab)
        eager, graphed = eager_and_graphed(items)
        if profile_first and profiled is None:
            session.piecewise = None
            profiled = {"chunk": chunk, "decode_rows": decode,
                        **kernel_profile(lambda: session.run(items), stream)}
            print(json.dumps(profiled), flush=True)
        tflops = step_flops(cost, chunk, decode, ctx) / graphed / 1e9
        session.piecewise = graphs  # the profile above ran eager
        launch = host_launch_ms(lambda: session.launch(items), stream)
        on_device = device_ms(lambda: session.launch(items), stream, launch)
        row = {"chunk": chunk, "decode_rows": decode, "eager_ms": round(eager, 3),
               "graphed_ms": round(graphed, 3), "eager_over_graphed": round(eager / graphed, 3),
               "graphed_launch_ms": round(launch, 3), "graphed_device_ms": round(on_device, 3),
               "graphed_TFLOPs": round(tflops, 1), "of_gemm_rate": round(tflops / rate, 3)}
        if profile_host:
            row["host_profile"] = host_profile(lambda: session.launch(items), stream)
        if repeated:
            same = eager_and_graphed(mixed_items(chunk, decode, ctx, state.block_size, vocab, repeated=True))
            row["eager_repeated_ms"], row["graphed_repeated_ms"] = (round(ms, 3) for ms in same)
        rows.append(row)
        print(json.dumps(row), flush=True)
    decode_only = decode_graph_steps(model, state, cfg.decode, sorted({d for d in decode_rows if d}), ctx, stream)
    result = {"gpu": torch.cuda.get_device_name(), "ctx": ctx, "gemm_TFLOPs": round(rate, 1), "steps": rows,
              "decode_graph": decode_only, "overrides": overrides or {}}
    result["fused_against_parts"] = fused_against_parts(result)
    if profiled:
        result["eager_profile"] = profiled
    return result


def decode_graph_steps(model, state, profile, row_counts: list[int], ctx: int, stream) -> list[dict]:
    """The decode worker's own step at each of `row_counts`: a decode session's full CUDA graph
    (its bucket from `profile`'s batch sizes; none past the largest), its rows at `ctx` cached
    tokens as in the mixed steps, timed as they are: with the host's launch, the launch alone,
    and on the device alone."""
    # only the decode graph: a row count past its buckets is left out, not run in pieces
    session = TorchSession(model, state.kv_pool, state.block_size, replace(profile, piecewise_graph_tokens=[]),
                           use_cuda_graphs=True)
    timed = []
    for count in row_counts:
        bucket = session.graphs.bucket(count) if session.graphs is not None else None
        if bucket is None:
            continue
        items = mixed_items(0, count, ctx, state.block_size, state.arch.vocab_size)
        graphed = time_ms(lambda: session.run(items), stream, repeats=10)
        launch = host_launch_ms(lambda: session.launch(items), stream)
        timed.append({"decode_rows": count, "bucket": bucket, "graphed_ms": round(graphed, 3),
                      "launch_ms": round(launch, 3),
                      "device_ms": round(device_ms(lambda: session.launch(items), stream, launch), 3)})
        print(json.dumps({"decode_graph": timed[-1]}), flush=True)
    session.release_graphs()
    return timed


def fused_against_parts(result: dict) -> list[dict]:
    """Each mixed step with a chunk and decode rows against its parts on the device: the decode
    graph at its rows (decode_graph) and, where measured, its chunk's prefill alone (the step of
    that chunk with no rows). `over_parts` below 1: the one step costs less than the two; the
    prompt tokens a millisecond it adds over the decode graph (`riding_tok_per_ms`) against the
    prefill's own (`alone_tok_per_ms`): what a prompt gains by riding in decode's step."""
    decode = {d["decode_rows"]: d["device_ms"] for d in result.get("decode_graph", [])}
    alone = {r["chunk"]: r["graphed_device_ms"] for r in result["steps"] if not r["decode_rows"]}
    rows = []
    for r in result["steps"]:
        chunk, count = r["chunk"], r["decode_rows"]
        if not chunk or count not in decode:
            continue
        fused, rows_alone = r["graphed_device_ms"], decode[count]
        row = {"chunk": chunk, "decode_rows": count, "fused_ms": fused, "decode_graph_ms": rows_alone,
               "added_ms": round(fused - rows_alone, 3),
               "riding_tok_per_ms": round(chunk / (fused - rows_alone), 1) if fused > rows_alone else None}
        if chunk in alone:
            row.update(prefill_alone_ms=alone[chunk], over_parts=round(fused / (rows_alone + alone[chunk]), 3),
                       alone_tok_per_ms=round(chunk / alone[chunk], 1))
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    lines = [f"{result['gpu']}: chunked's mixed step, decode rows at {result['ctx']} cached tokens; "
             f"bf16 GEMM rate {result['gemm_TFLOPs']} TFLOP/s in the same run; overrides {result.get('overrides', {})}",
             "", "| chunk | decode rows | eager ms | piecewise graphs ms | eager / graphed | graphed launch ms (host) "
             "| graphed ms on the device alone | graphed TFLOP/s | of GEMM rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['chunk']} | {r['decode_rows']} | {r['eager_ms']} | {r['graphed_ms']} | "
                     f"{r['eager_over_graphed']:.2f}x | {r.get('graphed_launch_ms', '-')} | "
                     f"{r.get('graphed_device_ms', '-')} | {r['graphed_TFLOPs']} | {r['of_gemm_rate']:.0%} |")
    if result.get("decode_graph"):
        lines += ["", "the decode worker's own step (its full CUDA graph, no prompt beside it):", "",
                  "| decode rows | graph bucket | graphed ms | launch ms (host) | ms on the device alone |",
                  "|---|---|---|---|---|"]
        lines += [f"| {d['decode_rows']} | {d['bucket']} | {d['graphed_ms']} | {d['launch_ms']} | {d['device_ms']} |"
                  for d in result["decode_graph"]]
    if result.get("fused_against_parts"):
        lines += ["", "fused against its parts, on the device alone (a mixed step run by the decode worker):", "",
                  "| chunk | decode rows | mixed ms | decode graph ms | prefill alone ms | mixed / (decode + prefill) "
                  "| prompt tok/ms over the decode graph | prompt tok/ms alone |", "|---|---|---|---|---|---|---|---|"]
        for f in result["fused_against_parts"]:
            over = f"{f['over_parts']:.2f}x" if "over_parts" in f else "-"
            lines.append(f"| {f['chunk']} | {f['decode_rows']} | {f['fused_ms']} | {f['decode_graph_ms']} | "
                         f"{f.get('prefill_alone_ms', '-')} | {over} | {f['riding_tok_per_ms'] or '-'} | "
                         f"{f.get('alone_tok_per_ms', '-')} |")
    if any("eager_repeated_ms" in r for r in result["steps"]):
        lines += ["", "one token id repeated (the steps earlier calibrations timed):", "",
                  "| chunk | decode rows | eager ms | piecewise graphs ms |", "|---|---|---|---|"]
        lines += [f"| {r['chunk']} | {r['decode_rows']} | {r['eager_repeated_ms']} | {r['graphed_repeated_ms']} |"
                  for r in result["steps"]]
    for r in result["steps"]:
        if "host_profile" in r:
            h = r["host_profile"]
            lines += ["", f"graphed launch, chunk {r['chunk']} + {r['decode_rows']} decode rows, profiled: "
                      f"{h['profiled_ms']} ms, host events {h['events_ms']} ms, outside them {h['outside_events_ms']} ms", "",
                      "| host event | calls | own ms |", "|---|---|---|"]
            lines += [f"| {e['name']} | {e['calls']} | {e['self_ms']} |" for e in h["events"]]
    if "eager_profile" in result:
        p = result["eager_profile"]
        lines += ["", f"eager step, chunk {p['chunk']} + {p['decode_rows']} decode rows: wall {p['wall_ms']} ms, "
                  f"GPU kernels {p['kernel_ms']} ms", "", "| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| {k['name']} | {k['calls']} | {k['ms']} |" for k in p["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench mixed-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--chunks", default="512,1024,2048", help="prompt tokens in the step")
    ap.add_argument("--decode-rows", default="0,64,256,512", help="decoding sequences in the step")
    ap.add_argument("--ctx", type=int, default=512, help="cached tokens of each decoding sequence")
    ap.add_argument("--repeated-tokens", action="store_true",
                    help="also time each step with one token id repeated")
    ap.add_argument("--profile", action="store_true", help="the first step's kernels, eager (torch.profiler)")
    ap.add_argument("--host-profile", action="store_true",
                    help="each step's graphed launch on an idle device: its host-side events by their own time")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine overrides (quantization=fp8-w8a8, kv.cache_dtype=fp8, ...)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    result = measure(args.engine_dir, ints(args.chunks), ints(args.decode_rows), args.ctx, args.repeated_tokens,
                     args.profile, args.host_profile, parse_overrides(args.set))
    print(markdown(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
