"""Piecewise CUDA graphs for steps that carry prefill tokens (chunked mode's mixed batches).

A decode step is one graph (engine/cuda_graphs.py) because its shapes depend only on the batch
size. A step with prompt tokens cannot be: attention's launch shapes and metadata follow the
batch's sequences. Everything else in a layer (norms, projections, RoPE, the MLP or the
experts) works on each token alone, so its shapes depend only on the token count. Here, as in
vLLM's piecewise graphs, a step of T tokens runs padded to a token bucket B >= T: one graph per
stretch between two attentions (embedding to layer 0's q/k/v, layer i's o_proj to layer i+1's
q/k/v, the last layer's o_proj to the final norm), and each layer's attention eagerly between
them over the T real tokens only, so padded rows never reach the KV cache. An MoE layer routes
the padded rows to no expert (T is read on the device at each replay): all alike, they would
otherwise land on the same k experts and cost what as many real tokens cost (a bucket's padding
is up to 255 tokens, more below 1024).

The pieces pass their results through static buffers (q, k, v, residual, attention output,
final hidden), which is what lets every graph of every bucket share one memory pool: nothing
a graph allocates outlives its replay. Padded rows compute on zeros and are never read.

``capture=False`` runs the same pieces over the same buffers without graphs (a CPU has none),
so the padding and buffer logic is checked without a GPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from bullet_trt.kernels.metadata import AttentionMetadata


class PiecewiseGraphs:
    def __init__(self, model, kv_pool: torch.Tensor, token_buckets: list[int], capture: bool = True):
        self.model = model
        self.kv_pool = kv_pool
        self.buckets = sorted(token_buckets)
        self.capture = capture
        n, device, dtype = self.buckets[-1], kv_pool.device, model.dtype
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.residual = torch.zeros(n, model.arch.hidden_size, dtype=dtype, device=device)
        self.attended = torch.zeros(n, attn.num_heads * attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, model.arch.hidden_size, dtype=dtype, device=device)
        self.real_rows = torch.zeros(1, dtype=torch.long, device=device)  # T of the step in flight
        # (stream, bucket) -> the num_layers + 1 pieces, graphs or (without capture) callables
        self.pieces: dict[tuple[int, int], list] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.side_stream: torch.cuda.Stream | None = None

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    # -- the pieces -----------------------------------------------------------------------------
    def _keep_head(self, b: int, q, k, v, residual) -> None:
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)
        self.residual[:b].copy_(residual)

    def _piece(self, i: int, b: int) -> Callable[[], None]:
        """Piece i of a b-token step: 0 is the embedding to layer 0's q/k/v; i in 1..L-1 is
        layer i-1 after its attention to layer i's q/k/v; L ends with the final norm."""
        m, ids, pos = self.model, self.input_ids[:b], self.positions[:b]

        def first() -> None:
            self._keep_head(b, *m.layer_head(0, m._embed(ids), None, pos))

        def between() -> None:
            hidden, residual = m.layer_tail(i - 1, self.attended[:b], self.residual[:b], self.real_rows)
            self._keep_head(b, *m.layer_head(i, hidden, residual, pos))

        def last() -> None:
            hidden, residual = m.layer_tail(i - 1, self.attended[:b], self.residual[:b], self.real_rows)
            self.hidden[:b].copy_(m.finish(hidden, residual))

        return first if i == 0 else last if i == self.num_layers else between

    # -- capture ------------------------------------------------------------------------------
    def _stream(self) -> torch.cuda.Stream | None:
        if not self.capture:
            return None
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():  # capture needs a side stream
            if self.side_stream is None:
                self.side_stream = torch.cuda.Stream()
            self.side_stream.wait_stream(stream)
            stream = self.side_stream
        return stream

    def _key(self, stream, b: int) -> tuple[int, int]:
        return (stream.cuda_stream if stream is not None else 0, b)

    def _build(self, b: int, stream) -> list:
        fns = [self._piece(i, b) for i in range(self.num_layers + 1)]
        if not self.capture:
            return fns
        for fn in fns:  # compile the Triton kernels and warm cuBLAS outside the capture
            fn()
        stream.synchronize()
        graphs = []
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                fn()
            graphs.append(graph)
        return graphs

    def release(self) -> None:
        """Frees the captured pieces (DecodeGraphs.release says why it matters)."""
        for pieces in self.pieces.values():
            for piece in pieces:
                if isinstance(piece, torch.cuda.CUDAGraph):
                    piece.reset()
        self.pieces.clear()

    def capture_all(self) -> int:
        """Captures every bucket's pieces for the current stream, the largest bucket first
        (smaller ones then fit in the memory it left in the pool); returns how many were new."""
        stream = self._stream()
        new = 0
        for b in reversed(self.buckets):
            key = self._key(stream, b)
            if key not in self.pieces:
                self.pieces[key] = self._build(b, stream)
                new += 1
        return new

    # -- a step -------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (T, hidden) of the T packed new tokens, as CausalLM.forward returns
        them; writes their K/V. A view of a static buffer: valid until the next run."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        stream = self._stream()
        key = self._key(stream, b)
        if key not in self.pieces:
            self.pieces[key] = self._build(b, stream)
        pieces = self.pieces[key]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.real_rows.fill_(t)
        self.input_ids[t:b].zero_()
        self.positions[t:b].zero_()
        self.attended[t:b].zero_()  # padded rows: zeros, never stale values that could overflow
        step = (lambda piece: piece.replay()) if self.capture else (lambda piece: piece())
        step(pieces[0])
        for i in range(self.num_layers):
            attended = self.model.layer_attention(i, self.q[:t], self.k[:t], self.v[:t], self.kv_pool, meta)
            self.attended[:t].copy_(attended)
            step(pieces[i + 1])
        return self.hidden[:t]
