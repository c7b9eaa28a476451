"""What one forward step tells the attention kernels about the packed batch."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from bullet_trt.kernels.host_to_device import device_tensor


def padded_tables(block_tables: list[list[int]], lengths: np.ndarray | None = None) -> np.ndarray:
    """(B, longest table) int32: each row its table, then zeros; one column for a batch of
    empty tables. `lengths`: the tables' lengths, where the caller has them already."""
    if lengths is None:
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = max(int(lengths.max()) if len(lengths) else 0, 1)
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    out[np.arange(width) < lengths[:, None]] = flat
    return out


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
        """The batch's metadata from the host's lists. In numpy, not Python loops: a mixed step
        of a few hundred decode rows brings thousands of block-table entries, and built from
        nested lists the metadata of 300 rows beside a 1024-token chunk took 3.3 ms of a
        two-core development host, 0.8 ms here (`bullet-trt bench host-step --rows 300`):
        host time the GPU waits for once a step's launch outruns it: chunked launched one ahead
        collapsed at 40 req/s on H200s with the lists and held that rate with this, on another
        host (docs/benchmarks.md, seventeenth round)."""
        q = np.asarray(q_lens, dtype=np.int64)
        total = np.asarray(seq_lens, dtype=np.int64)
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        tables = padded_tables(block_tables, lengths)
        needs = np.where(q > 0, (total + block_size - 1) // block_size, 0)
        short = np.flatnonzero(needs > lengths)
        if len(short):  # its slots would come from the padding: another sequence's block 0
            row = int(short[0])
            raise ValueError(f"sequence {row} of the batch reaches position {int(total[row]) - 1} with "
                             f"{int(lengths[row])} KV blocks of {block_size} tokens")
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        rows = np.repeat(np.arange(len(q)), q)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[rows] + (total - q)[rows]
        slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return AttentionMetadata(
            cu_seqlens_q=device_tensor(cu, torch.int32, device),
            seq_lens=device_tensor(total, torch.int32, device),
            block_tables=device_tensor(tables, torch.int32, device),
            slot_mapping=device_tensor(slots, torch.int64, device),
            max_seqlen_q=int(q.max()) if len(q) else 0,
            max_seqlen_k=int(total.max()) if len(total) else 0,
            block_size=block_size,
        )
