"""Kernel entry points. Every op has one signature; the implementation is chosen per device.

The torch reference (``reference.py``) runs everywhere. GPU kernels written in Triton live in
``triton_ops.py`` and are imported only when a CUDA device is in use, so CPU machines never
import Triton.
"""
from __future__ import annotations

import os

import torch

from bullet_trt.kernels import reference
from bullet_trt.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ops_for"]


def ops_for(device: torch.device | str):
    """The kernel module for tensors on ``device``: Triton kernels on CUDA, else the reference.

    BULLET_KERNELS=reference forces the torch reference on any device (for checks).
    """
    if torch.device(device).type == "cuda" and os.environ.get("BULLET_KERNELS") != "reference":
        try:
            from bullet_trt.kernels import triton_ops
            return triton_ops
        except ImportError:
            return reference
    return reference
