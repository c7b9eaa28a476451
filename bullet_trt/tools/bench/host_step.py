"""The host's share of a graphed decode step, measured against the way it was done before, in
one run on this host's CPU (no GPU needed: this is the part of a step the GPU waits for):

    bullet-trt bench host-step [--rows 1024] [--steps 200] [--json PATH]

Three pieces are timed over a batch that changes as a loaded server's does (each step one row
leaves, one joins, every row moves a token on, a row at a block's end gets the next block):
- staging the step's inputs (engine/graph_inputs.py) against writing every row's block table
  from scratch, as the decode graphs did before;
- masking banned tokens (engine/sampling._ban) against listing every (row, token) pair, with
  every row banning the same end tokens, as a fixed-length benchmark's requests do until their
  min_tokens. The mask is timed on a (rows, 8) float32 tensor: the scatter's work belongs to
  the device, the lists' to the host;
- the attention metadata of a mixed step, as chunked mode builds it each step (the batch's rows
  decoding beside a 1024-token chunk of a fresh prompt; kernels/metadata.py, in numpy) against
  the nested lists it was built from before. On the CPU: its device copies are not timed.
Each figure is the median milliseconds a step over `--steps` steps, and the ratio of the
baseline's to the current code's.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from bullet_trt.engine.graph_inputs import DecodeInputStaging
from bullet_trt.engine.sampling import _ban
from bullet_trt.kernels.metadata import AttentionMetadata
from bullet_trt.tools.bench.json_output import write_json

BLOCK = 16
MAX_BLOCKS = 256  # max_model_len 4096
END_IDS = [128001, 128008, 128009]  # Llama 3's end tokens
MIXED_CHUNK = 1024  # chunked mode's sized chunk on an H100 or H200


def stage_from_scratch(i64: np.ndarray, i32: np.ndarray, block_size: int, token_ids, positions, tables,
                       padded: int | None = None) -> None:
    """The decode graphs' staging before graph_inputs.py: every row written each step, the batch
    padded to `padded` rows (default: none) that read block 0 and write no KV. The reference
    the staging is tested against, too (tests/test_graph_inputs.py)."""
    rows = i64.shape[1]
    batch = len(token_ids)
    padded = batch if padded is None else padded
    i64[:2, batch:padded] = 0
    i64[2, batch:padded] = -1
    i64[0, :batch] = token_ids
    i64[1, :batch] = positions
    i64[2, :batch] = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    i32[:batch] = positions
    i32[:batch] += 1
    i32[batch:padded] = 1
    table_rows = i32[rows:].reshape(rows, -1)
    for row, t in zip(table_rows, tables):
        row[:len(t)] = t
    table_rows[batch:padded] = 0


def metadata_from_lists(q_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                        block_size: int) -> tuple[torch.Tensor, ...]:
    """A mixed step's attention metadata as AttentionMetadata.build made it before it moved to
    numpy: each token's slot in a Python loop, the tables padded as lists and made one nested-list
    tensor. Returns (cu_seqlens_q, seq_lens, block_tables, slot_mapping). The reference the build
    is tested against, too (tests/test_attention_metadata.py)."""
    cu, slots = [0], []
    for q_len, total, table in zip(q_lens, seq_lens, tables):
        cu.append(cu[-1] + q_len)
        for pos in range(total - q_len, total):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return (torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(padded, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64))


def with_chunk(positions: list[int], tables: list[list[int]], chunk: int, first_block: int):
    """A decode batch's rows with a `chunk`-token prompt chunk after them: (q_lens, seq_lens, tables)."""
    blocks = list(range(first_block, first_block + -(-chunk // BLOCK)))
    return [1] * len(positions) + [chunk], [p + 1 for p in positions] + [chunk], tables + [blocks]


def ban_by_pairs(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """The sampler's mask before _ban: one (row, token) pair per banned token, listed in Python."""
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")


class _Rows:
    """A decode batch that changes step by step as a loaded server's does."""

    def __init__(self, count: int, seed: int):
        self.rng = random.Random(seed)
        self.next_block = 0
        self.rows = [self._new() for _ in range(count)]

    def _new(self) -> list:
        blocks = self.rng.randint(5, 40)  # ShareGPT-like contexts of ~80-640 tokens
        table = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        return [table, blocks * BLOCK - self.rng.randint(1, BLOCK)]  # [table, position]

    def step(self) -> tuple[list[int], list[int], list[list[int]]]:
        self.rows.pop(self.rng.randrange(len(self.rows)))
        self.rows.append(self._new())
        for row in self.rows:
            row[1] += 1
            if row[1] // BLOCK >= len(row[0]) and len(row[0]) < MAX_BLOCKS:
                row[0].append(self.next_block)
                self.next_block += 1
        return [1] * len(self.rows), [row[1] for row in self.rows], [row[0] for row in self.rows]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(rows: int, steps: int, seed: int = 0) -> dict:
    batch = _Rows(rows, seed)
    i64 = np.zeros((3, rows), dtype=np.int64)
    i32 = np.zeros(rows + rows * MAX_BLOCKS, dtype=np.int32)
    staging = DecodeInputStaging(i64, i32, BLOCK, MAX_BLOCKS)
    scratch64, scratch32 = i64.copy(), i32.copy()
    banned = [list(END_IDS) for _ in range(rows)]
    logits = torch.zeros(rows, 8)
    times: dict[str, list[float]] = {"staging": [], "staging_before": [], "ban": [], "ban_before": [],
                                     "metadata": [], "metadata_before": []}
    # the end ids index a (rows, 8) tensor: the host's work is what is timed
    small = [[i % 8 for i in ids] for ids in banned]
    for _ in range(steps):
        args = batch.step()
        times["staging"].append(_timed(lambda: staging.fill(*args, rows)))
        times["staging_before"].append(_timed(lambda: stage_from_scratch(scratch64, scratch32, BLOCK, *args)))
        times["ban"].append(_timed(lambda: _ban(logits, small)))
        times["ban_before"].append(_timed(lambda: ban_by_pairs(logits, small)))
        mixed = with_chunk(args[1], args[2], MIXED_CHUNK, batch.next_block)
        times["metadata"].append(_timed(lambda: AttentionMetadata.build(*mixed, BLOCK, "cpu")))
        times["metadata_before"].append(_timed(lambda: metadata_from_lists(*mixed, BLOCK)))
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {"rows": rows, "steps": steps, "median_ms": ms,
            "staging_ratio": ms["staging_before"] / ms["staging"], "ban_ratio": ms["ban_before"] / ms["ban"],
            "metadata_ratio": ms["metadata_before"] / ms["metadata"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt bench host-step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024, help="decode rows a step (default 1024)")
    ap.add_argument("--steps", type=int, default=200, help="steps timed (default 200)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.rows < 2 or args.steps < 1:
        raise SystemExit("bullet-trt bench host-step: --rows must be >= 2 and --steps >= 1")
    result = run(args.rows, args.steps)
    ms = result["median_ms"]
    print(f"{args.rows} rows, median of {args.steps} steps, this host's CPU:")
    print(f"  staging the inputs: {ms['staging']:.3f} ms, row by row before: {ms['staging_before']:.3f} ms "
          f"({result['staging_ratio']:.1f}x)")
    print(f"  masking banned tokens: {ms['ban']:.3f} ms, by (row, token) pairs before: {ms['ban_before']:.3f} ms "
          f"({result['ban_ratio']:.1f}x)")
    print(f"  a mixed step's attention metadata (+ a {MIXED_CHUNK}-token chunk): {ms['metadata']:.3f} ms, "
          f"from nested lists before: {ms['metadata_before']:.3f} ms ({result['metadata_ratio']:.1f}x)")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
