"""A follower rank of the chunked engine: its shard of the weights and its KV heads' pool,
and a loop that runs every batch rank 0 runs, when rank 0 runs it (the model's collectives
pair the forwards). It samples what rank 0 samples, from the same gathered logits, and
throws it away: rank 0 alone keeps the requests."""
from __future__ import annotations

import traceback

from bullet_trt.config import EngineConfig
from bullet_trt.engine.block_journal import BlockReplica
from bullet_trt.engine.core import chunked_profile
from bullet_trt.engine.session import TorchSession
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.engine.step_failure import device_usable
from bullet_trt.engine.tp_group import TPGroup
from bullet_trt.engine.tp_messages import RankStep, RankStop


def run_chunked_follower(cfg: EngineConfig, group: TPGroup, free_counts) -> None:
    state, model = build_shared_state(cfg, share=False, tp=group)
    session = TorchSession(model, state.kv_pool, state.block_size, chunked_profile(cfg))
    session.warm_up()  # the same steps as rank 0's warm-up, collectives included
    # and the same captures (each one's warm-up forwards pair with rank 0's; parallel.decode_graphs)
    session.capture_graphs()
    try:
        follow_steps(group, BlockReplica(state.num_blocks), free_counts, session)
    finally:
        session.release_graphs()  # before the group goes (DecodeGraphs.release)


def follow_steps(group: TPGroup, replica: BlockReplica, free_counts, session=None) -> None:
    """Rank 0's messages until RankStop: the journal into the replica (whose free count goes
    where rank 0 reads it), and each batch through ``session`` (none: this rank runs its
    batches elsewhere, in its spatial workers)."""
    while True:
        match group.broadcast():
            case RankStop():
                return
            case RankStep(items=items, journal=journal, ack=ack):
                replica.replay(journal)
                free_counts[group.rank] = replica.num_free
                if items is not None and session is not None:
                    replica.check(items)
                    try:
                        session.run(items)
                    except Exception:
                        # rank 0 failed the same step with the same inputs and serves on
                        if not device_usable(session.device):
                            raise
                        traceback.print_exc()
                if ack:
                    group.barrier()
            case other:
                raise RuntimeError(f"unexpected message from rank 0: {other!r}")
