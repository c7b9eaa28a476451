"""A worker process that hosts one engine session over the shared weights and KV pool.

Messages are the small typed ones of bullet_trt/protocol.py. A RunBatch asks for one step
over the given BatchItems (prefill batches); DecodeUpdates maintain the worker's own decode
batch, which it steps on its own for as long as a row can step, sending a DecodeStep (tokens,
measured time) after each (see decode_batch.py; with `decode.overlap_steps` each step is launched
before the last one's tokens are read, overlapped_decode.py). The heavy state (weights, pool) crosses once,
in WorkerSetup, as shared-memory / CUDA IPC handles. The worker pins its work to its SM partition: at start-up it creates the streams of
every split it may be given (green contexts, libsmctrl masks) and per iteration only picks one.

A step that raises is reported and the worker goes on: BatchFailed for a prefill batch,
DecodeStepFailed with its rows for a decode step (those rows leave the batch). When the
device's context is broken it reports WorkerFatal and exits instead
(bullet_trt/engine/step_failure.py).

Under tensor parallelism every rank has a prefill and a decode worker on its own GPU; the
workers of one role form a group, whose rank 0 (the orchestrator's) hands the messages it
takes to the others (rank_mirror.py), so that all of them run every step together.
"""
from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections import Counter

import torch
import torch.multiprocessing as mp

from bullet_trt.engine.gc_freeze import freeze_startup_objects
from bullet_trt.engine.memory_watch import ReservedMemoryWatch
from bullet_trt.engine.shared_state import attach_session
from bullet_trt.engine.step_clock import GpuStepClock
from bullet_trt.engine.step_failure import device_usable
from bullet_trt.engine.tp_group import TPGroup
from bullet_trt.engine.tp_ranks import exit_with_parent
from bullet_trt.protocol import (BatchDone, BatchFailed, DecodeStep, DecodeUpdate, RowsLeft,
                                 RunBatch, SmSplit, StopWorker, WorkerFatal, WorkerReady, WorkerSetup)
from bullet_trt.spatial.decode_batch import PersistentDecodeBatch
from bullet_trt.spatial.decode_step_failure import WorkerBroken, fail_decode_step
from bullet_trt.spatial.overlapped_decode import OverlappedDecode
from bullet_trt.spatial.partitioners import make_partitioner
from bullet_trt.spatial.rank_mirror import FollowerOutbox, RankMirror


def worker_profiles(cfg) -> dict:
    """Each role's profile. The prefill worker replays piecewise graphs where
    `prefill.piecewise_graph_tokens` names buckets (sizing names them for a mixture-of-experts
    model, and leaves them empty for a dense one, which runs eagerly): it moves between SM
    partitions from step to step, each with a stream of its own, so it captures layers + 1
    graphs per token bucket on every partition at start. That pays where an eager prefill is
    bound by the host launching kernels, as a mixture-of-experts layer's many kernels are
    (docs/moe.md)."""
    return {"prefill": cfg.prefill, "decode": cfg.decode}


class WorkerDied(RuntimeError):
    pass


def _worker_main(name: str, env: dict, inbox, outbox, decode_epoch) -> None:
    # Before anything touches CUDA: MPS reads its thread percentage at context creation,
    # and unpickling the CUDA IPC handles below creates the context.
    os.environ.update(env)
    group = None
    try:
        setup: WorkerSetup = inbox.get()
        state, profile, partitioner_kind, splits = setup.state, setup.profile, setup.partitioner, setup.splits
        if setup.threads:
            torch.set_num_threads(setup.threads)
        if setup.tp is not None:
            rendezvous, rank = setup.tp
            group = TPGroup.join(rendezvous, rank, state.kv_pool.device)
        session = attach_session(state, profile, group=group.model_group if group else None)
        device = state.kv_pool.device
        spatial = device.type == "cuda" and partitioner_kind != "none"
        # A static MPS split is the one split it is given; two workers outside MPS only
        # time-slice, so a spatial partitioner insists on running as an MPS client.
        part = make_partitioner(partitioner_kind, device, require_mps=spatial,
                                prefill_sms=splits[0] if partitioner_kind == "mps" and splits else None)
        part.prepare(name, splits)
        set_num_sms = _kernel_sm_hook(device)
        # Workers start one after the other (the parent waits for "ready"), so each warm-up
        # has the still-empty pool to itself.
        session.warm_up()
        _capture_graphs(session, part, name, splits, set_num_sms)
        clock = _start_clock(device, part, splits) if setup.gpu_clock and device.type == "cuda" else None
        freeze_startup_objects()
        memory = ReservedMemoryWatch.for_device(name, device)  # it hands idle cache back too
        if memory is not None:
            memory.started()
        outbox.put(WorkerReady(name, os.getpid(), part.describe(), session.model.fused_groups,
                               _piecewise_ready(session)))
    except Exception:
        outbox.put(WorkerFatal(name, traceback.format_exc()))
        return
    mirror = RankMirror(inbox, group)
    if not mirror.leads:
        outbox = FollowerOutbox(outbox)
        exit_with_parent()  # it waits on rank 0's worker, not on its inbox
    batch = PersistentDecodeBatch(state.block_size, part.total_sms)
    overlap = None
    if profile.overlap_steps and group is None and hasattr(session, "launch"):
        clocks = [clock, _start_clock(device, part, splits)] if clock is not None else None
        overlap = OverlappedDecode(session, device, part, name, set_num_sms, batch, outbox, clocks, memory,
                                   publish_epoch=None if decode_epoch is None else _epoch_publisher(decode_epoch),
                                   launch_late=profile.overlap_launch_late)
    last_step_end: float | None = None
    stepped = False  # whether rows stepped last time round: likely they can step again
    parent = mp.parent_process()
    try:
        while True:
            # Block on the inbox only when no row stepped, no prompts wait for a step and no
            # step is in flight; otherwise take what is there. (When the rows that stepped
            # cannot step again, the next round finds none and blocks.)
            msgs = mirror.take(block=not stepped and not batch.prompt_groups and not (overlap and overlap.pending),
                               until=overlap.launch_due() if overlap is not None else None)
            if not msgs and parent is not None and not parent.is_alive():
                outbox.cancel_join_thread()  # orphaned: free the GPU
                return
            left: list[int] = []
            new_epoch = 0  # the last split epoch of this turn's updates, published once settled
            for msg in msgs:
                match msg:
                    case StopWorker():
                        return
                    case DecodeUpdate():
                        left += batch.apply(msg)
                        new_epoch = msg.epoch or new_epoch
                    case RunBatch(items=items, split=split, after_decode_epoch=epoch):
                        try:
                            waited_ms = _wait_for_epoch(decode_epoch, epoch, parent)
                            results, elapsed_ms, start, gpu_window = _timed_run(session, device, part, name, split,
                                                                                set_num_sms, items, clock)
                            outbox.put(BatchDone(name, results, elapsed_ms, start, waited_ms, gpu_window))
                            if memory is not None:
                                memory.after_step(items)
                        except Exception:
                            if not device_usable(device):
                                outbox.put(WorkerFatal(name, traceback.format_exc()))
                                return
                            outbox.put(BatchFailed(name, traceback.format_exc()))
            if new_epoch:
                if overlap is not None:
                    overlap.move_to(batch.split, new_epoch)  # published once the old split is done
                elif decode_epoch is not None:
                    # Between steps: nothing of this worker runs on the old split any more.
                    decode_epoch.value = new_epoch
            ran = batch.runnable()
            prompts = batch.take_prompts()
            stepped = bool(ran)
            if overlap is not None:
                if ran and not prompts:
                    left = overlap.step(ran, left)
                    continue
                # fused prompts step the plain way below; the step in flight reports first
                left = overlap.drain(left)
            if not ran and not prompts:
                if left:
                    outbox.put(RowsLeft(left))
                continue
            rows = [item for _, item in ran]
            try:
                results, elapsed_ms, start, gpu_window = _timed_run(session, device, part, name, batch.split,
                                                                    set_num_sms, rows + prompts, clock)
            except Exception:
                fail_decode_step(device, name, batch, outbox, ran, traceback.format_exc(), left, bool(prompts))
                continue
            row_results = results[:len(rows)]
            tokens = [r.token_id for r in row_results]
            step = DecodeStep(row_ids=[row_id for row_id, _ in ran], token_ids=tokens,
                              logprobs=[r.logprob for r in row_results], left=left, split=batch.split,
                              total_ctx=sum(it.start_pos + 1 for it in rows), start=start,
                              measured_ms=elapsed_ms,
                              idle_ms=None if last_step_end is None else (start - last_step_end) * 1e3,
                              prompt_results=results[len(rows):] if prompts else None,
                              prompt_tokens=sum(len(it.input_token_ids) for it in prompts), gpu_window_ns=gpu_window,
                              rows_without_block=batch.waiting_for_block)
            batch.advance(ran, tokens)
            last_step_end = time.monotonic()
            outbox.put(step)
            # after the tokens have left: the orchestrator need not wait for the allocator's books
            if memory is not None:
                memory.after_step(rows, prompts)
    except WorkerBroken:  # WorkerFatal is sent already
        return


def _epoch_publisher(decode_epoch):
    def publish(epoch: int) -> None:
        decode_epoch.value = epoch
    return publish


def _wait_for_epoch(decode_epoch, epoch: int, parent, limit_s: float = 5.0) -> float:
    """Waits until the decode worker runs at split `epoch` (it switches between two of its
    steps, so this is at most one decode step); returns the milliseconds waited. Past
    `limit_s` (a decode worker that stopped answering) it goes on, and the orchestrator
    learns of the dead worker from its exit."""
    if not epoch or decode_epoch is None:
        return 0.0
    start = time.monotonic()
    while decode_epoch.value < epoch:
        if time.monotonic() - start > limit_s or (parent is not None and not parent.is_alive()):
            break
        time.sleep(0.0002)
    return (time.monotonic() - start) * 1e3


def _timed_run(session, device, part, role: str, split: SmSplit, set_num_sms, items,
               clock: GpuStepClock | None = None):
    """Runs one step on this role's partition of `split`, waits for it; returns the results,
    the elapsed milliseconds and the start (time.monotonic()), and with a clock the step's
    window on the GPU's clock (else None)."""
    stream = part.stream(split.prefill)
    if set_num_sms is not None:
        set_num_sms(split.sms_of(role))
    start = time.monotonic()
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if clock is not None:
            clock.begin()
        results = session.run(items)
        if clock is not None:
            clock.finish()
    if stream is not None:
        stream.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
    return results, (time.monotonic() - start) * 1e3, start, clock.window_ns() if clock is not None else None


def _step_streams(part, splits: list[int]):
    """(prefill SMs of the split, its stream) for each partition the worker may be given and
    the whole GPU (None: the current stream)."""
    for prefill in dict.fromkeys([*splits, None]):  # a static MPS split first: it is its stream
        try:
            stream = part.stream(prefill)
        except ValueError:  # a static split serves only its own partition
            continue
        yield prefill, stream


def _start_clock(device, part, splits: list[int]) -> GpuStepClock:
    """The GPU step clock, its kernel compiled and loaded on every stream the worker steps on
    before serving, so that no step pays for it."""
    clock = GpuStepClock(device)
    for _, stream in _step_streams(part, splits):
        with torch.cuda.stream(stream):
            clock.warm_up()
        if stream is not None:  # a green context's stream: the device synchronize below misses it
            stream.synchronize()
    torch.cuda.synchronize(device)
    return clock


def _capture_graphs(session, part, role: str, splits: list[int], set_num_sms) -> None:
    """Every graph the worker may replay (each partition it can be given and the whole GPU,
    every decode batch bucket or prefill token bucket), captured before serving rather than
    at first use, where a capture would stall a step."""
    if getattr(session, "graphs", None) is None and getattr(session, "piecewise", None) is None:
        return
    for prefill, stream in _step_streams(part, splits):
        if set_num_sms is not None:
            set_num_sms(SmSplit(part.total_sms, prefill).sms_of(role))
        with torch.cuda.stream(stream):  # None: the current stream
            session.capture_graphs()
        if stream is not None:
            stream.synchronize()


def _piecewise_ready(session) -> dict[int, int]:
    """Token bucket -> on how many partitions its prefill pieces were built at start."""
    pieces = getattr(session, "piecewise", None)
    if pieces is None:
        return {}
    return dict(sorted(Counter(bucket for _, bucket in pieces.pieces).items()))


def _kernel_sm_hook(device):
    """The GPU kernels size their split-KV grids from the SMs they may use."""
    if device.type != "cuda":
        return None
    from bullet_trt.kernels import ops_for
    return getattr(ops_for(device), "set_num_sms", None)


class SessionWorker:
    """Parent-side handle of one worker. Results of every worker sharing `outbox` arrive
    there tagged with the worker's name, so an orchestrator can wait on all of them at once."""

    def __init__(self, name: str, state, profile, partitioner_kind: str = "none",
                 splits: list[int] | None = None, env: dict | None = None, outbox=None,
                 threads: int | None = None, start_timeout_s: float = 300.0, decode_epoch=None,
                 tp: tuple | None = None, gpu_clock: bool = False):
        ctx = mp.get_context("spawn")
        self.name = name
        self.inbox = ctx.Queue()
        self.outbox = outbox if outbox is not None else ctx.Queue()
        # decode_epoch: a shared counter (multiprocessing.RawValue) the decode worker sets to
        # the split epoch it runs at and the prefill worker waits on; shared by inheritance.
        self.proc = ctx.Process(target=_worker_main, args=(name, env or {}, self.inbox, self.outbox, decode_epoch),
                                name=f"bullet-{name}", daemon=True)
        self.proc.start()
        if threads is None and state.kv_pool.device.type == "cpu":
            # the cores shared out among the two workers of every rank
            threads = max(1, (os.cpu_count() or 2) // (2 * state.shard.size))
        # tp: (Rendezvous, rank) of this role's workers on every rank (rank_mirror.py)
        self.inbox.put(WorkerSetup(state, profile, threads, partitioner_kind, list(splits or []), tp, gpu_clock))
        ready = self._receive(start_timeout_s)
        if not isinstance(ready, WorkerReady):
            raise WorkerDied(f"{name} worker failed to start:\n{getattr(ready, 'trace', ready)}")
        self.pid = ready.pid
        self.partitions = ready.partitions
        # Projection groups the attached weights let it run as one GEMM (2 per layer when the
        # shared layout survived the trip into this process).
        self.fused_groups = ready.fused_groups
        self.piecewise = ready.piecewise

    def _receive(self, timeout_s: float | None = None):
        waited = 0.0
        while True:
            try:
                return self.outbox.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                if not self.proc.is_alive():
                    raise WorkerDied(f"{self.name} worker exited with code {self.proc.exitcode}")
                if timeout_s is not None and waited >= timeout_s:
                    raise WorkerDied(f"{self.name} worker did not answer in {timeout_s:.0f} s")

    def submit(self, items, split: SmSplit, after_decode_epoch: int = 0) -> None:
        self.inbox.put(RunBatch(items, split, after_decode_epoch))

    def send_update(self, update: DecodeUpdate) -> None:
        """Changes to the worker's own decode batch."""
        self.inbox.put(update)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put(StopWorker())
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
