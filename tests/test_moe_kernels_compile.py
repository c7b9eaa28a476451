"""The fused MoE's grouped GEMM compiles for Hopper (sm_90) in every form it can take, bf16 and
FP8 weights, plain and with the operands swapped, gate-and-up and down, on any machine (as
tests/test_sample_kernels_compile.py does for the sampling kernels, and for the same reason: the
interpreter runs code its compiler may refuse). Its own process: the interpreter, once set for
this one, replaces every kernel."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

COMPILE = textwrap.dedent("""
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bullet_trt.kernels import fp8_blocks, triton_moe as tm

    fn = tm._moe_gemm_kernel
    ints = ("N", "K", "num_valid", "num_rows", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_se",
            "stride_sn")
    for fp8, swap, gate_up in itertools.product((False, True), (False, True), (True, False)):
        sig = {n: "constexpr" for n in fn.arg_names}
        sig.update({n: "i32" for n in ints}, A="*bf16", C="*bf16", W="*bf16", SORTED="*i32", BLOCK_EXPERT="*i32",
                   NUM_PADDED="*i32", B="*fp8e4nv" if fp8 else "*bf16", S="*fp32" if fp8 else "*bf16")
        consts = dict(A_ROWS_PER_ID=8 if gate_up else 1, GATE_UP=gate_up, WEIGHTED=not gate_up,
                      FP8_BLOCK=fp8_blocks.BLOCK if fp8 else 0, SWAP_AB=swap, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                      GROUP_M=1, DOT_PREC="tf32", UPCAST=False)
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v
                                                                            for k, v in consts.items()}),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
        assert kernel.asm["cubin"]
        print(f"compiled fp8={int(fp8)} swap={int(swap)} gate_up={int(gate_up)}")
""")


def test_the_moe_gemm_compiles_for_hopper_in_every_form():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.split("\n")) - 1 == 8 and "compiled fp8=1 swap=1 gate_up=1" in done.stdout
