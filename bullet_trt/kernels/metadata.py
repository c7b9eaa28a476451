"""What one forward step tells the attention kernels about the packed batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bullet_trt.kernels.host_to_device import device_tensor


@dataclass
class AttentionMetadata:
    """Describes a packed batch of sequences, each bringing some new tokens.

    The new tokens of all sequences are packed along one token axis T. Sequence i owns
    packed rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its total context after this step is
    ``seq_lens[i]`` (tokens already cached plus the new ones), so its first new token sits at
    position ``seq_lens[i] - q_len_i``. The same description covers a whole-prompt prefill, a
    chunk of a prompt whose earlier chunks are cached, and a decode step (q_len 1).
    """

    cu_seqlens_q: torch.Tensor  # int32 (B+1,)
    seq_lens: torch.Tensor  # int32 (B,)
    block_tables: torch.Tensor  # int32 (B, max_blocks_per_seq), unused entries 0
    slot_mapping: torch.Tensor  # int64 (T,): block * block_size + offset of each new token
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1

    @staticmethod
    def build(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str) -> "AttentionMetadata":
        cu = [0]
        slots: list[int] = []
        for q_len, total, table in zip(q_lens, seq_lens, block_tables):
            cu.append(cu[-1] + q_len)
            for pos in range(total - q_len, total):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return AttentionMetadata(
            cu_seqlens_q=device_tensor(cu, torch.int32, device),
            seq_lens=device_tensor(seq_lens, torch.int32, device),
            block_tables=device_tensor(padded, torch.int32, device),
            slot_mapping=device_tensor(slots, torch.int64, device),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(seq_lens, default=0),
            block_size=block_size,
        )
