"""`bullet-trt bench decode-overlap`: the decode worker's steps one at a time against launched
one ahead (`decode.overlap_steps`), on one GPU, without a server.

    bullet-trt bench decode-overlap --engine-dir engines/llama-3.1-8b [--batch 512] [--ctx 512]
        [--steps 60] [--sms 108 [--switch-every 4]] [--launch-late] [--set KEY=VALUE ...] [--json out.json]

Both loops are the worker's own code: a persistent decode batch of `--batch` rows (each bans
its end tokens, as a benchmark's requests do until their min_tokens) stepped by the plain path
(`TorchSession.run`, then the batch takes the tokens) and by `OverlappedDecode`. Each prints
its period (host wall time a step) against the GPU's own time for a step (steps launched back
to back), so the overlapped loop's gain is the ratio of the periods measured in the same run.
With `--sms` the steps run on a green-context partition of that many SMs, as the decode
worker runs beside a prefill; the overlapped loop keeps two GPU step clocks, as the worker
does under an iteration log. With `--switch-every N` decode moves between that partition and
the whole GPU every N steps in both loops, as a server's prefills start and end: the overlapped
loop then launches each step after a change on the new partition's stream, queued behind the
step in flight on the old one (`OverlappedDecode.move_to`). With `--launch-late` the overlapped
loop waits before each launch until `OverlappedDecode.launch_due` (`decode.overlap_launch_late`):
its gaps then say what launching that late costs the GPU. Greedy, both loops must pick the
same tokens from the same state:
the command says whether they did (and exits 1 if not), unless the pool is too small for the
batch's rows to have blocks of their own.

The overlapped loop's own figures: the GPU window of each step and the GPU's idle time between
steps (CUDA events), and the host time of a launch and of a report (which waits for the step
before). Then a few overlapped steps under torch.profiler, the host's time by call: a loop
that does not gain has a call between one launch and the next that waits for the device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bullet_trt.config import load_engine_config, parse_overrides
from bullet_trt.engine.gc_freeze import freeze_startup_objects
from bullet_trt.engine.kv_pool import fill_random
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem
from bullet_trt.engine.shared_state import attach_session, build_shared_state
from bullet_trt.engine.step_clock import GpuStepClock
from bullet_trt.protocol import DecodeStep, DecodeUpdate, SmSplit
from bullet_trt.serving.device_sizing import GRAPH_BUCKETS, MAX_DECODE_ROWS
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
from bullet_trt.spatial.overlapped_decode import OverlappedDecode
from bullet_trt.spatial.partitioners import make_partitioner
from bullet_trt.spatial.session_worker import worker_profiles
from bullet_trt.tools.bench.json_output import write_json


class _Collect:
    """The worker's outbox, kept here: the decode steps' reports."""

    def __init__(self):
        self.sent: list = []

    def put(self, msg) -> None:
        self.sent.append(msg)


def decode_rows(batch: int, ctx: int, steps: int, block_size: int, pool_blocks: int,
                banned: list[int]) -> list[tuple[int, BatchItem]]:
    """`batch` rows at `ctx` cached tokens with blocks for `steps` more; rows share blocks once
    the pool runs out (attention reads them all the same)."""
    per_row = -(-(ctx + steps + 2) // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=10**9, min_tokens=10**9)
    rows = []
    for r in range(batch):
        first = (r * per_row) % max(pool_blocks - per_row, 1)
        rows.append((r, BatchItem(f"r{r}", [1 + r % 1000], ctx, list(range(first, first + per_row)), params,
                                  True, output_index=1, banned_token_ids=list(banned))))
    return rows


def decode_split(total_sms: int, prefill_splits: list[int], decode_sms: int | None) -> SmSplit:
    """The split that gives decode `decode_sms` SMs (None: the whole GPU). Decode gets what a
    prefill partition leaves, so only `total_sms` minus an offered prefill size will do; on an
    H200's 132 SMs with green's step of 8 that is 12..124 step 8, and 64 is not among them."""
    if decode_sms is None:
        return SmSplit.whole(total_sms)
    offered = sorted(total_sms - s for s in prefill_splits)
    if decode_sms not in offered:
        sizes = f"{offered[0]}..{offered[-1]} step {offered[1] - offered[0]}" if len(offered) > 1 else str(offered)
        raise SystemExit(f"bench decode-overlap: --sms {decode_sms} is not a decode partition on this GPU: "
                         f"decode gets the SMs a prefill partition leaves of the {total_sms}, here {sizes}")
    return SmSplit(total_sms, total_sms - decode_sms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench decode-overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sms", type=int, default=None, help="decode's partition (green context); default: whole GPU")
    ap.add_argument("--switch-every", type=int, default=0,
                    help="with --sms: move decode between its partition and the whole GPU every N steps, as a "
                         "server's prefills start and end (the overlapped loop launches across the change)")
    ap.add_argument("--launch-late", action="store_true",
                    help="launch each overlapped step shortly before the one in flight is due to end "
                         "(decode.overlap_launch_late), as the worker then does")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine overrides (quantization=fp8-w8a8, kv.cache_dtype=fp8, ...)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench decode-overlap needs a CUDA GPU")
    if args.switch_every and args.sms is None:
        raise SystemExit("bench decode-overlap: --switch-every needs --sms (the partition to switch with)")

    # checked before the engine loads (a minute for a large model): a bad --sms fails at once
    part = make_partitioner("green", torch.device("cuda", torch.cuda.current_device()))
    total = part.total_sms
    split = decode_split(total, part.splits(), args.sms)

    # decode slots and graphs as a GPU server sizes them (engine.yaml's suit a CPU)
    overrides = parse_overrides(args.set)
    cfg = load_engine_config(args.engine_dir, {**overrides, "kv.gpu_memory_fraction": 0.5,
                                               "decode.max_num_seqs": MAX_DECODE_ROWS,
                                               "decode.max_num_batched_tokens": MAX_DECODE_ROWS,
                                               "decode.cuda_graph_batch_sizes": list(GRAPH_BUCKETS)})
    state, _ = build_shared_state(cfg, share=False)
    fill_random(state.kv_pool)  # attention reads cached tokens of random data, not zeros
    profile = worker_profiles(cfg)["decode"]
    session = attach_session(state, profile)
    session.warm_up()
    if session.graphs is None or session.graphs.bucket(args.batch) is None:
        raise SystemExit(f"bench decode-overlap: no decode CUDA graph holds {args.batch} rows")
    device = state.kv_pool.device
    splits = [split, SmSplit.whole(total)] if args.switch_every else [split]
    part.prepare("decode", [s.prefill for s in splits if s.prefill is not None])
    set_num_sms = getattr(session.model.ops, "set_num_sms", None)
    for s in reversed(splits):  # each split's stream its graphs, as the worker captures them; the first last
        if set_num_sms is not None:
            set_num_sms(s.sms_of("decode"))
        with torch.cuda.stream(part.stream(s.prefill)):
            session.capture_graphs()
        part.stream(s.prefill).synchronize()
    stream = part.stream(split.prefill)

    def split_of(step: int) -> SmSplit:
        """The split of a loop's step: both loops step on the same splits in the same order."""
        return splits[(step // args.switch_every) % 2] if args.switch_every else split

    # as the worker does once started: a full collection walking the model's and the graphs'
    # objects pauses the host for tens of milliseconds, in whichever loop it falls
    freeze_startup_objects()
    banned = list(state.arch.eos_token_ids)
    total_steps = 2 * args.steps + args.profile_steps + 8

    def fresh_batch() -> PersistentDecodeBatch:
        batch = PersistentDecodeBatch(state.block_size, total)
        batch.apply(DecodeUpdate(joins=decode_rows(args.batch, args.ctx, total_steps, state.block_size,
                                                   state.num_blocks, banned), split=split))
        return batch

    report: dict = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "ctx": args.ctx,
                    "decode_sms": split.sms_of("decode"), "steps": args.steps, "switch_every": args.switch_every,
                    "launch_late": args.launch_late, "overrides": overrides,
                    "kv_cache_dtype": str(state.kv_pool.dtype).removeprefix("torch.")}

    plain_batch = fresh_batch()

    plain_tokens: list[list[int]] = []

    def plain_step() -> None:
        ran = plain_batch.runnable()
        now = split_of(len(plain_tokens))
        if set_num_sms is not None:
            set_num_sms(now.sms_of("decode"))
        with torch.cuda.stream(part.stream(now.prefill)):  # the step before was read: nothing in flight
            results = session.run([item for _, item in ran])
        plain_tokens.append([r.token_id for r in results])
        plain_batch.advance(ran, plain_tokens[-1])

    def timed(step, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    timed(plain_step, 4)  # each plain step runs on its split's stream
    plain_ms = timed(plain_step, args.steps)
    # the GPU's own time for a step: the graph's replay with its inputs staged, back to back
    ran = plain_batch.runnable()
    items = [item for _, item in ran]
    if set_num_sms is not None:
        set_num_sms(split.sms_of("decode"))
    with torch.cuda.stream(stream):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(10):
            session.launch(items)
        ev[1].record()
    ev[1].synchronize()
    gpu_ms = ev[0].elapsed_time(ev[1]) / 10

    outbox = _Collect()
    overlap_batch = fresh_batch()
    # two GPU clocks, as the worker has them when the server keeps an iteration log
    clocks = [GpuStepClock(device), GpuStepClock(device)]
    with torch.cuda.stream(stream):
        for clock in clocks:  # its kernel compiled before the timed steps
            clock.warm_up()
    stream.synchronize()
    overlap = OverlappedDecode(session, device, part, "decode", set_num_sms, overlap_batch, outbox, clocks,
                               launch_late=args.launch_late)
    launched: list = []  # each step as launched: its events and its launch's host time
    step_host_ms: list[float] = []

    launches = [0]  # the overlapped loop's steps so far, warm-up and profile included

    def overlapped_step() -> None:
        due = overlap.launch_due()
        if due is not None:  # as the worker takes its inbox's messages until then
            time.sleep(max(due - time.monotonic(), 0.0))
        t0 = time.perf_counter()
        now = split_of(launches[0])
        if now != overlap_batch.split:  # as a server's update moves the worker's batch
            overlap_batch.apply(DecodeUpdate(split=now, epoch=launches[0] + 1))
            overlap.move_to(now, launches[0] + 1)
        launches[0] += 1
        overlap.step(overlap_batch.runnable(), [])
        step_host_ms.append((time.perf_counter() - t0) * 1e3)
        launched.append(overlap.pending)

    timed(overlapped_step, 4)
    launched.clear()
    step_host_ms.clear()
    overlap_ms = timed(overlapped_step, args.steps)
    launch_ms = [s.host_ms for s in launched]
    # a step's call launches the next step, then reports the one before: the rest is the report
    report_ms = [whole - own for whole, own in zip(step_host_ms, launch_ms)]
    windows = [s.began.elapsed_time(s.ended) for s in launched]
    gaps = [a.ended.elapsed_time(b.began) for a, b in zip(launched, launched[1:])]
    med = statistics.median
    # Both loops stepped the same rows from the same state: greedy, they must agree token for
    # token, unless rows share KV blocks (a pool too small for the batch), which makes them race.
    per_row = len(plain_batch.rows[0].block_table)
    reported = [m.token_ids for m in outbox.sent if isinstance(m, DecodeStep)]
    compared = min(len(reported), len(plain_tokens))  # the last step launched is not reported yet
    same = (None if args.batch * per_row > state.num_blocks - per_row
            else reported[:compared] == plain_tokens[:compared])
    report["same_tokens"] = same
    report["steps_compared"] = compared if same is not None else 0
    report.update(plain_period_ms=round(plain_ms, 3), overlapped_period_ms=round(overlap_ms, 3),
                  gpu_step_ms=round(gpu_ms, 3), plain_idle_share=round(1 - gpu_ms / plain_ms, 4),
                  overlapped_idle_share=round(1 - gpu_ms / overlap_ms, 4),
                  overlapped_over_plain=round(plain_ms / overlap_ms, 4),
                  overlapped_window_ms_p50=round(med(windows), 3), overlapped_gap_ms_p50=round(med(gaps), 3),
                  # the means and tails: an idle share the medians do not show lies in a few steps
                  overlapped_window_ms_mean=round(statistics.fmean(windows), 3),
                  overlapped_window_ms_max=round(max(windows), 3),
                  overlapped_gap_ms_mean=round(statistics.fmean(gaps), 3), overlapped_gap_ms_max=round(max(gaps), 3),
                  overlapped_gaps_over_half_ms=sum(g > 0.5 for g in gaps),
                  overlapped_gaps_ms_first=[round(g, 3) for g in gaps[:12]],
                  overlapped_launch_host_ms_p50=round(med(launch_ms), 3),
                  overlapped_report_host_ms_p50=round(med(report_ms), 3))
    print(json.dumps(report), flush=True)
    if same is False:
        print("bench decode-overlap: the overlapped loop's tokens differ from the plain loop's", flush=True)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(args.profile_steps):
            overlapped_step()
        overlap.drain([])
        torch.cuda.synchronize()
    table = prof.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=25,
                                                        max_name_column_width=60)
    print(f"host time of {args.profile_steps} overlapped steps, by call (self CPU time):\n{table}", flush=True)
    write_json(args.json, report)
    return 1 if same is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
