"""The tile product every Triton kernel here uses, and the one switch it needs on CPU.

The Triton interpreter (TRITON_INTERPRET=1, CPU) computes bf16 ``tl.dot`` wrongly; there the
kernels feed fp32 copies of the (already rounded) operands to ``tl.dot`` instead, so the
interpreter tests check the kernels' indexing and masking, not the interpreter's bf16 path.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

UPCAST_DOT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation (a, b of one dtype); UPCAST: pass UPCAST_DOT."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c
