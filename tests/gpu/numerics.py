"""Comparison against a reference, and where kernels can run, shared by the GPU tests."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device:
    """Where a test module of Triton kernels runs them: the GPU, else the Triton interpreter
    on CPU when TRITON_INTERPRET=1; otherwise the calling module is skipped."""
    if not (CUDA or INTERPRET):
        pytest.skip("Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    return torch.device("cuda" if CUDA else "cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64; inf when `out` holds NaN or inf, which is
    how an unwritten element of a NaN-poisoned output (or a read past a context) shows."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
