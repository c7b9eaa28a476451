"""What rank 0 tells the other tensor-parallel ranks, over the group's gloo channel
(engine.tp_group.TPGroup.broadcast). They live in the engine layer, below
bullet_trt/protocol.py, because the chunked engine sends them; the spatial modes send the
same two, and their workers mirror protocol.py's own messages (spatial/rank_mirror.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from bullet_trt.engine.block_journal import Journal
from bullet_trt.engine.session import BatchItem


@dataclass
class RankStep:
    """Replay ``journal`` into the block replica; then, with ``items``, run that batch with
    rank 0 (the model's collectives pair the ranks' forwards). ``ack``: meet rank 0 at a
    barrier afterwards, so that its stats read this rank's count after the journal."""

    items: list[BatchItem] | None = None
    journal: Journal = field(default_factory=list)
    ack: bool = False


@dataclass
class RankStop:
    pass
