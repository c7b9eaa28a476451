"""Expert weights in FP8 (E4M3) with one float32 scale per 128 x 128 block, the layout of the
published fine-grained FP8 checkpoints (DeepSeek-V3's, Qwen3's "-FP8"): a weight W (rows, cols)
is stored as q = W / s, rounded to E4M3, with s = amax(|W| over the block) / 448 per block of
128 rows and 128 columns, so that q * s gives W back to E4M3's three mantissa bits. The kernels
multiply by the scale after each 128-wide step of the reduction, so the matrix products run in
the activations' dtype on weights read at one byte each: half the bytes a bf16 expert costs.

A stacked gate-and-up tensor (experts, 2 * inter, hidden) keeps the gate's and the up's blocks
apart (the gate's ceil(inter / 128) rows of scales, then the up's), as the two per-expert
tensors of a checkpoint hold them, whatever ``inter`` is.

Activations, where they are rounded to FP8 too (quantization=fp8-w8a8, both operands of the
products on FP8 tensor cores), take a scale per token and 128 columns, computed as each step
runs (``quantize_token_groups``), as the published FP8 checkpoints' "dynamic" activation scheme
says.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # E4M3's largest finite value
BLOCK = 128
BYTES_PER_WEIGHT = 1 + 4 / BLOCK ** 2  # the E4M3 byte, and its share of its block's float32 scale


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _quantize_blocks(w: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in FP8, a float32 scale per block of ``block_rows`` x BLOCK) for w (..., rows, cols)."""
    *lead, rows, cols = w.shape
    rb, cb = -(-rows // block_rows), -(-cols // BLOCK)
    padded = torch.zeros(*lead, rb * block_rows, cb * BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    blocks = padded.view(*lead, rb, block_rows, cb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, rb * block_rows, cb * BLOCK)[..., :rows, :cols].contiguous(), scale


def _dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_rows: int, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    full = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :rows, :cols]
    return (q.to(torch.float32) * full).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in FP8, scales float32 (..., ceil(rows / 128), ceil(cols / 128))) for w (..., rows, cols)."""
    return _quantize_blocks(w, BLOCK)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W (..., rows, cols) in ``dtype`` from its FP8 blocks and their scales."""
    return _dequantize_blocks(q, scale, BLOCK, dtype)


def quantize_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked (..., 2 * inter, hidden) gate-and-up tensor: its gate and up halves quantized
    apart, their scales one after the other along the rows."""
    gate, up = w.chunk(2, dim=-2)
    (qg, sg), (qu, su) = quantize(gate), quantize(up)
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def dequantize_gate_up(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    gate, up = q.chunk(2, dim=-2)
    sg, su = scale.chunk(2, dim=-2)
    return torch.cat([dequantize(gate, sg, dtype), dequantize(up, su, dtype)], dim=-2)


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's stacked experts as FP8 blocks: fused_moe's keyword arguments for them."""
    (gate_up, gate_up_scale), (down, down_scale) = quantize_gate_up(w_gate_up), quantize(w_down)
    return dict(w_gate_up=gate_up, w_down=down, gate_up_scale=gate_up_scale, down_scale=down_scale)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in FP8, scales float32 (rows, ceil(cols / 128))) for activations x (rows, cols): one
    scale per row and 128 columns."""
    return _quantize_blocks(x, 1)


def dequantize_token_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_blocks(q, scale, 1, dtype)
