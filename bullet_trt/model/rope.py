"""Rotary position embedding tables, computed exactly as transformers computes inv_freq."""
from __future__ import annotations

import math

import torch

from bullet_trt.model.arch import ModelArch

ROPE_TYPES = ("default", "linear", "llama3")


def inv_freq(arch: ModelArch) -> torch.Tensor:
    dim = arch.head_dim
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{arch.source}: rope type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError(f"{arch.source}: partial_rotary_factor is not supported")
    # Same op order as transformers (int64 arange, then float) so tables agree to the last bit.
    freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        return freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def build_cos_sin_cache(arch: ModelArch, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """(max_positions, head_dim) float32: first half cos, second half sin (kernels.apply_rope)."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq(arch)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
