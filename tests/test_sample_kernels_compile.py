"""The sampling kernels compile for Hopper (sm_90, the H100's and H200's) on any machine:
Triton's interpreter, which runs them in the CPU tests, accepts code its compiler refuses, and a
kernel that does not compile would first fail on a GPU. The compile runs in a process of its
own, since the interpreter, once set for this one (scripts/test.sh), replaces every kernel."""
from __future__ import annotations

import textwrap

import pytest

from tests.hopper_compile import compile_script_output

pytest.importorskip("triton")

COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bullet_trt.kernels import triton_sample as ts

    tail = {"logits_ptr": "*fp32", "stride_row": "i64", "temp_ptr": "*fp32", "top_p_ptr": "*fp32",
            "keys_ptr": "*i64", "norm_ptr": "*fp32", "hi_ptr": "*fp32", "complete_ptr": "*i8",
            "tokens_ptr": "*i64", "vocab": "i32", "BLOCK": "constexpr", "ROUNDS": "constexpr"}
    draw = {"logits_ptr": "*bf16", "stride_row": "i64", "rows_ptr": "*i64", "temp_ptr": "*fp32",
            "keys_ptr": "*i64", "out_ptr": "*i64", "vocab": "i32", "BLOCK": "constexpr"}
    for fn, sig, consts in ((ts._nucleus_tail_kernel, tail, {"BLOCK": ts.BLOCK, "ROUNDS": 96}),
                            (ts._gumbel_argmax_kernel, draw, {"BLOCK": ts.BLOCK})):
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], fn.__name__
        print("compiled", fn.__name__)
""")


def test_the_sampling_kernels_compile_for_hopper():
    out = compile_script_output(COMPILE, timeout=600)
    assert out.split() == ["compiled", "_nucleus_tail_kernel", "compiled", "_gumbel_argmax_kernel"]
