"""Comparison against a reference, shared by the GPU tests."""
from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64; inf when `out` holds NaN or inf, which is
    how an unwritten element of a NaN-poisoned output (or a read past a context) shows."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
