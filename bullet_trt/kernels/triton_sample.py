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
def _gumbel_noise(v, key):
    """-log(-log(u)) in float64 for vocabulary indices v under a row's key (reference.gumbel_noise)."""
    h = (v.to(tl.uint64) * 0x27D4EB2F) & 0xFFFFFFFF
    h = _fmix32(_fmix32(key ^ h) ^ key)
    u = (h.to(tl.float64) + 0.5) / 4294967296.0
    return -tl.log(-tl.log(u))


@triton.jit
def _scaled(base, v, vocab, temp, other):
    """A row's logits at indices v over its temperature (`other` past the row's end), divided
    round-to-nearest, as torch's `/` is: fp32 `/` may lower to an approximate one."""
    return tl.div_rn(tl.load(base + v, mask=v < vocab, other=other).to(tl.float32), temp)


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
        # round-to-nearest division, as torch's: fp32 `/` may lower to an approximate one
        g = tl.div_rn(x, temp).to(tl.float64) + _gumbel_noise(v, key)
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


@triton.jit
def _nucleus_tail_kernel(logits_ptr, stride_row, temp_ptr, top_p_ptr, keys_ptr, norm_ptr, hi_ptr, complete_ptr,
                         tokens_ptr, vocab, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    i = tl.program_id(0)
    if tl.load(complete_ptr + i) == 0:
        temp = tl.load(temp_ptr + i).to(tl.float32)
        top_p = tl.load(top_p_ptr + i).to(tl.float32)
        key = tl.load(keys_ptr + i).to(tl.uint64)
        norm = tl.load(norm_ptr + i).to(tl.float32)
        base = logits_ptr + i.to(tl.int64) * stride_row
        offs = tl.arange(0, BLOCK)
        # below every finite scaled logit: the mass above it is the whole row's, at least top_p
        low = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            v = start + offs
            s = _scaled(base, v, vocab, temp, float("inf"))
            low = tl.minimum(low, tl.where(s > float("-inf"), s, float("inf")))
        lo = tl.min(low, axis=0) - 1.0
        # the last of the candidates: kept, so the mass above it is below top_p
        hi = tl.load(hi_ptr + i).to(tl.float32)
        settled = lo >= hi  # no scaled logit strictly between lo and hi: each is kept or not
        for _ in range(ROUNDS):
            if settled == 0:
                mid = lo + (hi - lo) * 0.5
                above = tl.zeros([BLOCK], tl.float32)
                between = tl.zeros([BLOCK], tl.int32)
                for start in range(0, vocab, BLOCK):
                    v = start + offs
                    s = _scaled(base, v, vocab, temp, float("-inf"))
                    above += tl.where(s > mid, tl.exp(s - norm), 0.0)
                    between += ((s > lo) & (s < hi)).to(tl.int32)
                settled = (tl.sum(between, axis=0) == 0) | (mid <= lo) | (mid >= hi)
                if settled == 0:
                    if tl.sum(above, axis=0) < top_p:
                        hi = mid
                    else:
                        lo = mid
        # the kept tokens are those at or above hi: the Gumbel-max among them, as the reference's
        best = tl.full([BLOCK], float("-inf"), tl.float64)
        best_idx = tl.zeros([BLOCK], tl.int64)
        for start in range(0, vocab, BLOCK):
            v = start + offs
            s = _scaled(base, v, vocab, temp, float("-inf"))
            g = tl.where((v < vocab) & (s >= hi), s.to(tl.float64) + _gumbel_noise(v, key), float("-inf"))
            better = g > best
            best = tl.where(better, g, best)
            best_idx = tl.where(better, v.to(tl.int64), best_idx)
        top = tl.max(best, axis=0)
        tl.store(tokens_ptr + i, tl.min(tl.where(best == top, best_idx, vocab), axis=0))


def nucleus_tail_draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor,
                      norm: torch.Tensor, last_candidate: torch.Tensor, complete: torch.Tensor,
                      tokens: torch.Tensor) -> None:
    """Redraws, in `tokens`, each row of `logits` (R, V) whose top-p nucleus reached past its
    candidates (`complete` false): the row's kept tokens are those whose scaled logit has less
    than top_p of the row's probability above it (engine/sampling._kept's rule), found without
    sorting the row by bisecting on the threshold between the row's lowest scaled logit and its
    last candidate's (`last_candidate`, kept), one pass over the row a round, until no scaled
    logit lies strictly between the bounds (some 20-40 rounds for a 128k vocabulary); then the
    Gumbel-max among those at or above the upper bound under the row's key. `norm`: each row's
    log-normalizer of logits / temperature. A settled row's program returns at once, so the
    call queues on the device and nothing waits for it: the sort it replaces needed the host to
    know which rows to sort. (The threshold's masses are summed in another order than the
    sort's running sum; they can disagree only on a token whose preceding mass is within
    float32 rounding of top_p.)"""
    if logits.shape[0] == 0:
        return
    assert logits.stride(1) == 1, "the kernel reads each row's logits contiguously"
    _nucleus_tail_kernel[(logits.shape[0],)](logits, logits.stride(0), temperature, top_p, keys, norm,
                                             last_candidate, complete.to(torch.int8), tokens, logits.shape[1],
                                             BLOCK=BLOCK, ROUNDS=96)
