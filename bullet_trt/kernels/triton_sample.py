"""The seeded categorical draw of ``reference.gumbel_argmax`` as one Triton kernel: a program per
row streams the row's logits once, hashing each vocabulary index into its Gumbel noise on the
fly, and keeps the running argmax. The torch reference materialises the noise: several int64
(rows, vocab) tensors, gigabytes for a thousand rows of a 128k vocabulary, which a decode
worker at high concurrency has no room for.

The hash runs in uint64 with 32-bit masks, as the reference's int64 arithmetic does, and the
noise in float64 (u's 32 bits do not fit float32 near 1, where -log(u) would round to 0), so
both pick the same token for the same inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, rows_ptr, temp_ptr, keys_ptr, out_ptr, vocab,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    temp = tl.load(temp_ptr + i).to(tl.float32)
    key = tl.load(keys_ptr + i).to(tl.uint64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_idx = tl.zeros([BLOCK], tl.int64)
    for start in range(0, vocab, BLOCK):
        v = start + offs
        inside = v < vocab
        x = tl.load(logits_ptr + row * stride_row + v, mask=inside, other=float("-inf")).to(tl.float32)
        h = (v.to(tl.uint64) * 0x27D4EB2F) & 0xFFFFFFFF
        h = _fmix32(_fmix32(key ^ h) ^ key)
        u = (h.to(tl.float64) + 0.5) / 4294967296.0
        # round-to-nearest division, as torch's: fp32 `/` may lower to an approximate one
        g = tl.div_rn(x, temp).to(tl.float64) - tl.log(-tl.log(u))
        g = tl.where(inside, g, float("-inf"))
        better = g > best  # strictly: within a lane the earlier index stays on a tie
        best = tl.where(better, g, best)
        best_idx = tl.where(better, v.to(tl.int64), best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    tl.store(out_ptr + i, first)


def gumbel_argmax(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                  keys: torch.Tensor) -> torch.Tensor:
    """``reference.gumbel_argmax``, one program per drawn row."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    if rows.shape[0] == 0:
        return out
    assert logits.stride(1) == 1, "the kernel reads each row's logits contiguously"
    _gumbel_argmax_kernel[(rows.shape[0],)](logits, logits.stride(0), rows, temperature, keys, out,
                                            logits.shape[1], BLOCK=BLOCK)
    return out
