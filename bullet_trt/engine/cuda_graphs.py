"""CUDA graphs for decode steps: one graph per (stream, padded batch size).

A decode step of a large model is hundreds of small kernel launches; replaying a captured
graph removes the launch gaps. A graph runs on the SM set of the stream it was captured on
(docs/gpu-facts.md, fact 4), so each SM partition's stream gets its own graphs; they share one
memory pool and one logits buffer (a process replays one graph at a time). Inputs live in
static buffers that every replay reads; padded rows write no KV (slot -1) and their logits
are dropped. A worker captures every (partition, bucket) graph at start (`capture_all`), so
no capture lands in the middle of serving when the scheduler first picks a split.
"""
from __future__ import annotations

import torch

from bullet_trt.engine.graph_inputs import DecodeInputStaging
from bullet_trt.engine.step_in_flight import TokenFeed
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
        # Static inputs that every replay reads, in two device buffers (one per dtype) so a
        # step refills them with three copies from matching pinned host buffers.
        self.dev_i64 = torch.zeros(3, n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots = self.dev_i64
        self.dev_i32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = self.dev_i32[:n]
        self.block_tables = self.dev_i32[n:].view(n, self.max_blocks)
        self.host_i64 = torch.zeros(3, n, dtype=torch.long).pin_memory()
        self.host_i32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32).pin_memory()
        self.staging = DecodeInputStaging(self.host_i64.numpy(), self.host_i32.numpy(), block_size, self.max_blocks)
        self.copied = torch.cuda.Event()  # the host buffers are free again once this fires
        self.slots.fill_(-1)  # captures before the first real step must not write KV
        self.seq_lens.fill_(1)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.empty(n, model.arch.vocab_size, dtype=model.dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
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

    def _forward(self, b: int, meta: AttentionMetadata) -> None:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_pool, meta)
        self.model.compute_logits(hidden, out=self.logits[:b])

    def _capture(self, b: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        meta = self._meta(b)
        for _ in range(2):  # compile the Triton kernels and warm cuBLAS outside the capture
            self._forward(b, meta)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._forward(b, meta)
        return graph

    def _capture_stream(self) -> torch.cuda.Stream:
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            # Capture needs a side stream; a plain one spans the same (whole) device.
            if self.side_stream is None:
                self.side_stream = torch.cuda.Stream()
            self.side_stream.wait_stream(stream)
            stream = self.side_stream
        return stream

    def release(self) -> None:
        """Frees the captured graphs. Under tensor parallelism they hold the NCCL communicator:
        destroying the process group while they live never returns (rank 0 hung there)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def capture_all(self) -> int:
        """Captures every bucket's graph for the current stream now; returns how many were new.
        The kernels' SM count (``set_num_sms``) must already be the stream's."""
        stream = self._capture_stream()
        new = 0
        for b in self.batch_sizes:
            if (stream.cuda_stream, b) not in self.graphs:
                self.graphs[(stream.cuda_stream, b)] = self._capture(b, stream)
                new += 1
        return new

    def _stage(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
               b: int) -> None:
        """Fills the static inputs for a batch padded to b (graph_inputs.py)."""
        n = self.dev_i64.shape[1]
        self.copied.synchronize()
        self.staging.fill(token_ids, positions, block_tables, b)
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32[:n].copy_(self.host_i32[:n], non_blocking=True)
        span = slice(n, n + b * self.max_blocks)
        self.dev_i32[span].copy_(self.host_i32[span], non_blocking=True)
        self.copied.record()

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            feed: TokenFeed | None = None) -> torch.Tensor:
        """Logits (B, V) in the model's dtype for one decode token per sequence, on the current
        stream: a view of the graphs' buffer, valid until the next replay. No float32 copy is
        made here: one per step, of a new size whenever the batch grows, left the caching
        allocator a segment per size (engine/sampling.float32_scratch says why that grew a
        decode worker by gigabytes); the sampler copies into its own buffer instead."""
        batch = len(token_ids)
        b = self.bucket(batch)
        stream = self._capture_stream()
        key = (stream.cuda_stream, b)
        self._stage(token_ids, positions, block_tables, b)
        if feed is not None:  # tokens the host has not seen yet, from the step before
            feed.apply(self.input_ids)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, stream)
        self.graphs[key].replay()  # into the current stream, whichever stream captured it
        return self.logits[:batch]
