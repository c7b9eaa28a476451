"""Rank 0's side of tensor parallelism: one follower process per other rank, started here,
joined in one group, fed what rank 0 decided and stopped with it.

The engine that schedules (EngineCore, or the spatial orchestrator) is rank 0 and decides
every step once. A follower runs ``target`` ("module:function", called with the
configuration, its TPGroup and the shared free-block counts) once it has joined: the chunked
engine's followers run each step's batch beside rank 0 (engine/tp_follower.py), the spatial
modes' start a prefill and a decode worker of their own (spatial/rank_follower.py). Each
follower writes its pool's free blocks into shared memory, so that rank 0's stats show every
rank's pool; the ranks are processes of one host.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib
import os
import signal
import threading
import time

import torch
import torch.multiprocessing as mp

from bullet_trt.config import ConfigError, EngineConfig
from bullet_trt.engine.block_journal import JournaledAllocator
from bullet_trt.engine.session import BatchItem, EngineSession, SampleResult
from bullet_trt.engine.tp_group import NO_MULTICAST, Rendezvous, TPGroup, rank_device
from bullet_trt.engine.tp_messages import RankStep, RankStop
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.tensor_parallel import Shard


def cpu_threads(size: int) -> int:
    """Threads per rank on CPU: the cores shared out, so that no rank's collective waits on a
    rank starved by the others' threads."""
    return max(1, (os.cpu_count() or 2) // size)


class RankDied(RuntimeError):
    pass


def check_ranks(cfg: EngineConfig) -> None:
    """Refuses, before any process starts, a size that does not split the model or that names
    more GPUs than there are."""
    size = cfg.parallel.tensor_parallel_size
    Shard(0, size).check(ModelArch.from_checkpoint(cfg.checkpoint_path))
    last = rank_device(cfg.resolve_device(), size - 1)
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ConfigError(f"parallel.tensor_parallel_size={size} needs {last} (rank r on "
                          f"{rank_device(cfg.resolve_device(), 0)} + r); {torch.cuda.device_count()} GPUs visible")


class TensorParallelRanks:
    def __init__(self, cfg: EngineConfig, target: str):
        check_ranks(cfg)
        size = cfg.parallel.tensor_parallel_size
        ctx = mp.get_context("spawn")
        rendezvous = Rendezvous.new(size)
        self.free_counts = ctx.Array("q", size, lock=False)  # each follower's free KV blocks
        on_cpu = cfg.resolve_device() == "cpu"
        threads = cpu_threads(size) if on_cpu else 0
        # Every process below inherits it, workers too; each rank sets it again before NCCL.
        os.environ.update(NO_MULTICAST)
        # Not daemons: a spatial follower starts worker processes of its own. They end with
        # this process (atexit below, or their own watch on it).
        self.procs = [ctx.Process(target=follower_main, name=f"bullet-rank{rank}", daemon=False,
                                  args=(target, cfg, rank, rendezvous, self.free_counts, threads))
                      for rank in range(1, size)]
        for p in self.procs:
            p.start()
        atexit.register(self._kill)
        if threads:
            torch.set_num_threads(threads)
        try:
            self.group = TPGroup.join(rendezvous, 0, rank_device(cfg.resolve_device(), 0))
        except BaseException:
            self._kill()
            raise

    @property
    def size(self) -> int:
        return self.group.size

    def pool_ready(self, num_blocks: int) -> None:
        """Every rank's pool starts empty (a follower writes its own count from its first step)."""
        for rank in range(1, self.size):
            self.free_counts[rank] = num_blocks

    def follower_free_blocks(self) -> list[int]:
        return [self.free_counts[rank] for rank in range(1, self.size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def send(self, msg: RankStep) -> None:
        if not self.alive():
            dead = next(p for p in self.procs if not p.is_alive())
            raise RankDied(f"tensor-parallel {dead.name} exited with code {dead.exitcode}")
        self.group.broadcast(msg)
        if msg.ack:
            self.group.barrier()

    def sync(self, allocator: JournaledAllocator, wait: bool = True) -> None:
        """Hands the followers the blocks taken and freed since the last step; ``wait``: until
        they have counted them, so that the stats rank 0 reports next show them (an idle
        engine's would otherwise show the followers' pools as they were)."""
        journal = allocator.take_journal()
        if journal:
            self.send(RankStep(None, journal, ack=wait))

    def close(self) -> None:
        if self.alive():
            try:
                self.group.broadcast(RankStop())
            except RuntimeError:
                pass  # a follower is gone; the others fail on the broken group and exit
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        atexit.unregister(self._kill)
        self.group.close()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class LeaderSession(EngineSession):
    """Rank 0's session: every batch goes to all ranks first, with the KV blocks handed out
    and taken back since the last one, and runs on all of them together."""

    def __init__(self, session, ranks: TensorParallelRanks, allocator: JournaledAllocator):
        self.session, self.ranks, self.allocator = session, ranks, allocator
        self.profile, self.device, self.model = session.profile, session.device, session.model

    def run(self, items: list[BatchItem]) -> list[SampleResult | None]:
        self.ranks.send(RankStep(items, self.allocator.take_journal()))
        return self.session.run(items)

    def release_graphs(self) -> None:
        self.session.release_graphs()


def exit_with_parent() -> None:
    """A follower blocked in a collective cannot look at its parent; this thread does, so
    that no rank outlives the engine that leads it."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        while parent.is_alive():
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follower_main(target: str, cfg: EngineConfig, rank: int, rendezvous: Rendezvous, free_counts,
                  threads: int) -> None:
    """A follower process: joins the group as ``rank``, then runs ``target``. ``kill -USR1``
    on it prints every thread's stack: a rank stuck in a collective shows where."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    exit_with_parent()
    if threads:
        torch.set_num_threads(threads)
    group = TPGroup.join(rendezvous, rank, rank_device(cfg.resolve_device(), rank))
    try:
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(cfg, group, free_counts)
    finally:
        group.close()
