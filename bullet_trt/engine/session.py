"""Engine sessions: run one forward step over a batch of sequences and sample.

A session owns no scheduling state. It receives small, picklable `BatchItem`s (token ids to
feed, where they start, the block table, sampling parameters), so the same session runs
in-process or inside a worker process that attached the shared weights and KV pool.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from bullet_trt.config import ProfileConfig
from bullet_trt.engine.sampling import SamplingBatch, SamplingParams, float32_scratch, sample
from bullet_trt.engine.step_in_flight import Readback, SampleResult, StepInFlight, TokenFeed
from bullet_trt.kernels.host_to_device import device_tensor
from bullet_trt.kernels.metadata import AttentionMetadata


@dataclass
class BatchItem:
    request_id: str
    input_token_ids: list[int]  # the new tokens whose K/V this step writes
    start_pos: int  # position of input_token_ids[0]; tokens before it are cached
    block_table: list[int]
    params: SamplingParams
    sample: bool  # False for a prompt chunk that is not the last one
    output_index: int = 0  # which output token a sample is (keys the seeded noise)
    banned_token_ids: list[int] = field(default_factory=list)


class EngineSession(ABC):
    """prefill(items) and decode(items) return one SampleResult (or None) per item."""

    profile: ProfileConfig

    @abstractmethod
    def run(self, items: list[BatchItem]) -> list[SampleResult | None]:
        ...

    def prefill(self, items: list[BatchItem]) -> list[SampleResult | None]:
        return self.run(items)

    def decode(self, items: list[BatchItem]) -> list[SampleResult | None]:
        return self.run(items)

    def release_graphs(self) -> None:
        """Frees whatever CUDA graphs the session captured (before its ranks' group goes)."""


class TorchSession(EngineSession):
    """Runs the PyTorch model of bullet_trt.model over the paged pool."""

    def __init__(self, model, kv_pool: torch.Tensor, block_size: int, profile: ProfileConfig,
                 use_cuda_graphs: bool = True):
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.profile = profile
        self.device = kv_pool.device
        self.graphs = None
        if hasattr(model.ops, "use_cublaslt"):
            model.ops.use_cublaslt()
        from bullet_trt.kernels import reference
        # Graphs need kernels that never sync with the host; the torch reference does. Under
        # tensor parallelism decode replays graphs only where the collectives may be captured
        # too (parallel.decode_graphs: NCCL's, every rank capturing and replaying the same
        # graphs in the same order); otherwise it runs eager.
        graphable = model.ops is not reference and (model.shard.single or model.tp.in_graphs)
        if (use_cuda_graphs and self.device.type == "cuda" and profile.cuda_graph_batch_sizes
                and graphable):
            from bullet_trt.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, kv_pool, block_size, profile.cuda_graph_batch_sizes,
                                       profile.max_model_len)
        self.sample_scratch = (float32_scratch(self.graphs.batch_sizes[-1], model.arch.vocab_size, self.device)
                               if self.graphs is not None else None)
        # two, since a step's tokens are read while the next step's are on their way
        self._readbacks = ([Readback(max(profile.max_num_seqs, 1)) for _ in range(2)]
                           if self.device.type == "cuda" else [])
        self.piecewise = None
        if use_cuda_graphs and profile.piecewise_graph_tokens and model.shard.single:
            from bullet_trt.engine.piecewise_graphs import PiecewiseGraphs
            # Without graphs (a CPU, or host-syncing reference kernels) the pieces run as they
            # are: the same results, checked on CPU, at no gain.
            self.piecewise = PiecewiseGraphs(model, kv_pool, [int(t) for t in profile.piecewise_graph_tokens],
                                             capture=self.device.type == "cuda" and graphable)

    def warm_up(self) -> None:
        """Compiles the GPU kernels before the first request (Triton compiles on first use,
        most of a second per kernel form) with throwaway steps: Triton specializes integer
        arguments equal to 1 or divisible by 16, so the shapes below reach each form of
        every kernel (token counts of each kind, prefill-only and mixed prefill-and-decode
        batches of every sequence-tile size), and the decode kernels' split forms are
        compiled directly. Call it only before any request holds KV blocks: it writes into
        the first blocks of the pool."""
        if self.device.type != "cuda":
            return
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        bs, limit = self.block_size, self.profile.max_model_len - 1
        shapes = [[64], [13], [13, 7], [3] * 16, [3] * 17]
        next_block = 0
        # eager: graphs are captured per stream later
        graphs, self.graphs, piecewise, self.piecewise = self.graphs, None, self.piecewise, None
        for lengths in shapes:
            items = []
            for n in lengths:
                n = min(n, limit)
                table = list(range(next_block, next_block + -(-(n + 1) // bs)))
                next_block += len(table)
                items.append(BatchItem("warm-up", [1] * n, 0, table, greedy, True))
            self.run(items)
            # the same sequences' next token: a decode step, then one mixed with a prefill
            step = [BatchItem("warm-up", [1], len(it.input_token_ids), it.block_table, greedy, True,
                              output_index=1) for it in items]
            self.run(step)
            self.run(step[:1] + items[1:])
        # The prefill kernel's tile over sequences is sized by the batch's sequence count
        # (next power of two): a mixed batch and a prefill-only batch of every tile size up
        # to the session's largest batch.
        sizes, p = [], 32
        while p // 2 < self.profile.max_num_seqs:
            sizes.append(p)
            p *= 2
        shared = list(range(next_block, next_block + 64))  # warm-up output is never read
        for b in sizes:
            rows = [BatchItem("warm-up", [1] * 3, 0, shared[:1], greedy, True)]
            decode_rows = [BatchItem("warm-up", [1], 0, [shared[i % 64]], greedy, True) for i in range(1, b)]
            self.run(rows + decode_rows)
            if b * 2 <= self.profile.max_num_batched_tokens:
                self.run([BatchItem("warm-up", [1] * 2, 0, [shared[i % 64]], greedy, True) for i in range(b)])
        self.graphs, self.piecewise = graphs, piecewise
        ops = self.model.ops
        arch = self.model.arch
        if hasattr(ops, "compile_decode_variants"):
            attn = self.model.model.layers[0].self_attn  # this rank's heads under tensor parallelism
            ops.compile_decode_variants(attn.num_heads, attn.num_kv_heads, arch.head_dim,
                                        self.model.dtype, bs, self.device, self.kv_pool.dtype)
        if arch.moe_layers and hasattr(ops, "compile_moe_variants"):
            # the tiles of large prefills, which the short warm-up steps above never pick
            _, local_experts = self.model.shard.experts(arch)
            ops.compile_moe_variants(local_experts, arch.hidden_size, arch.moe_intermediate_size,
                                     arch.num_experts_per_tok, self.model.dtype, self.device, self.model.fp8_experts,
                                     self.model.fp8_activations)
        torch.cuda.synchronize(self.device)

    def release_graphs(self) -> None:
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()

    def capture_graphs(self) -> int:
        """Captures the decode graph of every batch bucket (and the piecewise graphs of every
        token bucket) for the current stream now (and its SM count), instead of at a bucket's
        first use; returns how many buckets were new."""
        new = self.graphs.capture_all() if self.graphs is not None else 0
        return new + (self.piecewise.capture_all() if self.piecewise is not None else 0)

    def _graph_logits(self, items: list[BatchItem], feed: TokenFeed | None) -> torch.Tensor | None:
        if self.graphs is None or not all(len(it.input_token_ids) == 1 and it.sample for it in items):
            return None
        if self.graphs.bucket(len(items)) is None:
            return None
        return self.graphs.run([it.input_token_ids[0] for it in items], [it.start_pos for it in items],
                               [it.block_table for it in items], feed)

    def run(self, items: list[BatchItem]) -> list[SampleResult | None]:
        return self.launch(items).results()

    @torch.inference_mode()
    def launch(self, items: list[BatchItem], feed: TokenFeed | None = None) -> StepInFlight:
        """Queues a step on the current stream and returns it without waiting for its tokens
        (engine/step_in_flight.py). `feed`: input tokens of one-token items taken from an
        earlier step's sampled tokens on the device."""
        if not items:
            return StepInFlight(0, [], [], None, None)
        logits = self._graph_logits(items, feed)
        if logits is not None:
            return self._sample(items, list(range(len(items))), logits)
        q_lens = [len(it.input_token_ids) for it in items]
        if feed is not None and any(q_lens[i] != 1 for i in feed.rows):
            raise ValueError("a token feed feeds only items of one input token")
        seq_lens = [it.start_pos + n for it, n in zip(items, q_lens)]
        meta = AttentionMetadata.build(q_lens, seq_lens, [it.block_table for it in items],
                                       self.block_size, self.device)
        ids = [t for it in items for t in it.input_token_ids]
        positions = [p for it, n in zip(items, q_lens) for p in range(it.start_pos, it.start_pos + n)]
        input_ids = device_tensor(ids, torch.long, self.device)
        if feed is not None:
            offsets = list(itertools.accumulate(q_lens, initial=0))  # each item's first token
            TokenFeed(feed.source, [offsets[i] for i in feed.rows], feed.src).apply(input_ids)
        pos = device_tensor(positions, torch.long, self.device)
        if self.piecewise is not None and self.piecewise.bucket(len(ids)) is not None:
            hidden = self.piecewise.run(input_ids, pos, meta)
        else:
            hidden = self.model(input_ids, pos, self.kv_pool, meta)
        rows = [i for i, it in enumerate(items) if it.sample]
        if not rows:
            return StepInFlight(len(items), [], [], None, None)
        last = meta.cu_seqlens_q[1:].long() - 1
        logits = self.model.compute_logits(hidden[last[device_tensor(rows, torch.long, self.device)]])
        return self._sample(items, rows, logits)

    def _sample(self, items: list[BatchItem], rows: list[int], logits: torch.Tensor) -> StepInFlight:
        picked = [items[i] for i in rows]
        batch = SamplingBatch.build([it.params for it in picked], [it.output_index for it in picked],
                                    [it.banned_token_ids for it in picked], self.device)
        tokens, logprobs = sample(logits, batch, self.sample_scratch, self.model.ops)
        readback = None
        if self.device.type == "cuda":
            readback, self._readbacks = self._readbacks[0], self._readbacks[::-1]
        return StepInFlight(len(items), rows, [it.params.logprobs for it in picked], tokens, logprobs, readback)
