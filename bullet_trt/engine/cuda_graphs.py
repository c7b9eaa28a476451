"""CUDA graphs for decode steps: one graph per (stream, padded batch size).

A decode step of a large model is hundreds of small kernel launches; replaying a captured
graph removes the launch gaps. A graph runs on the SM set of the stream it was captured on
(DESIGN.md section 2), so each SM partition's stream gets its own graphs; they share one
memory pool. Inputs live in static buffers that every replay reads; padded rows write no
KV (slot -1) and their logits are dropped.
"""
from __future__ import annotations

import torch

from bullet_trt.kernels.metadata import AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, kv_pool: torch.Tensor, block_size: int, batch_sizes: list[int],
                 max_model_len: int):
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        device = kv_pool.device
        n = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side_stream: torch.cuda.Stream | None = None

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def _meta(self, b: int) -> AttentionMetadata:
        # max_seqlen_k fixes the kernels' launch shapes at capture; the true lengths are read
        # from seq_lens on the device at every replay.
        return AttentionMetadata(self.cu_seqlens[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                 self.slots[:b], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
                                 block_size=self.block_size)

    def _capture(self, b: int, stream: torch.cuda.Stream):
        meta = self._meta(b)
        for _ in range(2):  # compile the Triton kernels and warm cuBLAS outside the capture
            self.model.compute_logits(self.model(self.input_ids[:b], self.positions[:b], self.kv_pool, meta))
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_pool, meta)
            logits = self.model.compute_logits(hidden)
        return graph, logits

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Logits (B, V) for one decode token per sequence, on the current stream."""
        batch = len(token_ids)
        b = self.bucket(batch)
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            # Capture needs a side stream; a plain one spans the same (whole) device.
            if self.side_stream is None:
                self.side_stream = torch.cuda.Stream()
            self.side_stream.wait_stream(stream)
            stream = self.side_stream
        key = (stream.cuda_stream, b)
        pad = b - batch
        self.input_ids[:b].copy_(torch.tensor(token_ids + [0] * pad, device="cpu").pin_memory(), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad).pin_memory(), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32).pin_memory(),
                                non_blocking=True)
        table = torch.zeros(b, self.max_blocks, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_tables[:b].copy_(table.pin_memory(), non_blocking=True)
        slots = [t[p // self.block_size] * self.block_size + p % self.block_size
                 for t, p in zip(block_tables, positions)] + [-1] * pad
        self.slots[:b].copy_(torch.tensor(slots, dtype=torch.int64).pin_memory(), non_blocking=True)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, stream)
        graph, logits = self.graphs[key]
        graph.replay()  # into the current stream, whichever stream captured it
        return logits[:batch]
