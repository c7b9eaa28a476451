"""A follower rank of the spatial modes: its shard of the weights and its KV heads' pool,
shared with a prefill and a decode worker of its own on its GPU (each an MPS client there).
Those workers take their messages from rank 0's workers (rank_mirror.py); this process only
starts them, counts its pool's blocks as rank 0 hands them out and takes them back, and
stops them when rank 0 stops."""
from __future__ import annotations

import torch.multiprocessing as mp

from bullet_trt.config import EngineConfig
from bullet_trt.engine.block_journal import BlockReplica
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.engine.tp_follower import follow_steps
from bullet_trt.engine.tp_group import TPGroup
from bullet_trt.protocol import WorkerPlan
from bullet_trt.spatial.session_worker import SessionWorker, worker_profiles


def run_spatial_follower(cfg: EngineConfig, group: TPGroup, free_counts) -> None:
    state, _ = build_shared_state(cfg, share=True, tp=group)
    plan: WorkerPlan = group.broadcast()
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()  # start-up and fatal errors only (rank_mirror.FollowerOutbox)
    decode_epoch = ctx.RawValue("q", 0)  # this GPU's decode worker's split epoch
    workers = []
    try:
        for role, profile in worker_profiles(cfg).items():
            workers.append(SessionWorker(role, state, profile, plan.partitioner, plan.splits, plan.envs[role],
                                         outbox=outbox, decode_epoch=decode_epoch,
                                         tp=(plan.rendezvous[role], group.rank)))
        follow_steps(group, BlockReplica(state.num_blocks), free_counts)
    finally:
        # rank 0's workers hand theirs the stop; close() waits for it, then kills
        for w in workers:
            w.close()
