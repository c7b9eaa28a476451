"""The fused MoE's grouped GEMM compiles for Hopper (sm_90) in every form it can take, bf16 and
FP8 weights, bf16 and FP8 activations with FP8 weights, plain and with the operands swapped,
gate-and-up and down, and so do the activations' FP8 rounding, the sum over each token's experts
and the router's top k, with 16-byte loads where a launch specializes their widths, on any machine (as
tests/test_sample_kernels_compile.py does for the sampling kernels; tests/hopper_compile.py says
why in a process of its own)."""
from __future__ import annotations

import textwrap

import pytest

from tests.hopper_compile import compile_script_output

pytest.importorskip("triton")

COMPILE = textwrap.dedent("""
    import itertools
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bullet_trt.kernels import fp8_blocks, triton_moe as tm

    fn = tm._moe_gemm_kernel
    ints = ("N", "K", "num_valid", "num_rows", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_se",
            "stride_sn", "stride_asm")
    # weights and activations: bf16 / bf16, FP8 / bf16, FP8 / FP8
    for (fp8, a_fp8), swap, gate_up in itertools.product(((0, 0), (1, 0), (1, 1)), (0, 1), (1, 0)):
        sig = {n: "constexpr" for n in fn.arg_names}
        sig.update({n: "i32" for n in ints}, A="*fp8e4nv" if a_fp8 else "*bf16", C="*bf16", W="*bf16",
                   SORTED="*i32", BLOCK_EXPERT="*i32", NUM_PADDED="*i32", B="*fp8e4nv" if fp8 else "*bf16",
                   S="*fp32" if fp8 else "*bf16", AS="*fp32" if a_fp8 else "*bf16")
        consts = dict(A_ROWS_PER_ID=8 if gate_up else 1, GATE_UP=bool(gate_up), WEIGHTED=not gate_up,
                      FP8_BLOCK=fp8_blocks.BLOCK if fp8 else 0, A_FP8=bool(a_fp8), SWAP_AB=bool(swap), BLOCK_M=16,
                      BLOCK_N=64, BLOCK_K=128, GROUP_M=1, DOT_PREC="tf32", UPCAST=False)
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v
                                                                            for k, v in consts.items()}),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
        assert kernel.asm["cubin"]
        print(f"compiled fp8={fp8} a_fp8={a_fp8} swap={swap} gate_up={gate_up}")
    def compiled(fn, sig, consts, num_warps):
        # what a launch specializes: pointers and the integers Triton may (not do_not_specialize)
        # marked as dividing by 16, as the model's widths and strides do
        index = {name: (fn.arg_names.index(name),) for name in fn.arg_names}
        attrs = {index[name]: [["tt.divisibility", 16]] for name, kind in sig.items()
                 if kind.startswith("*") or (kind == "i32" and name not in fn.do_not_specialize)}
        sig = {**sig, **{name: "constexpr" for name in consts}}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs={index[k]: v for k, v in consts.items()},
                                        attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    def vector_loads_only(ptx):  # 16 bytes a thread per load: the memory-bound kernels' pace
        return "ld.global.v4.b32" in ptx and not re.search(r"ld[.]global([.][a-z0-9]+)*[.]b(8|16) ", ptx)

    sig = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "rows": "i32", "cols": "i32", "stride_x": "i32",
           "stride_q": "i32", "stride_s": "i32"}
    ptx = compiled(tm._quantize_token_groups_kernel, sig, dict(ROWS=tm.QUANTIZE_ROWS, GROUP=fp8_blocks.BLOCK),
                   4).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # round to nearest, as torch does
    assert vector_loads_only(ptx) and "st.global.v4.b32" in ptx
    print("compiled quantize")
    sig = {"Y": "*bf16", "IDS": "*i32", "OUT": "*bf16", "T": "i32", "H": "i32", "expert_offset": "i32"}
    ptx = compiled(tm._moe_sum_kernel, sig, dict(E=128, K=8, BLOCK_T=8, BLOCK_H=256), 4).asm["ptx"]
    assert "ld.global.v4.b32" in ptx
    print("compiled sum")
    from bullet_trt.kernels import triton_route
    sig = {"LOGITS": "*bf16", "W": "*bf16", "IDS": "*i32", "T": "i32", "stride_l": "i32"}
    consts = dict(E=128, E_PAD=128, K=8, K_PAD=8, ROWS=triton_route.ROUTE_ROWS, RENORMALIZE=True)
    assert "ld.global.v4.b32" in compiled(triton_route._moe_route_kernel, sig, consts, 4).asm["ptx"]
    print("compiled route")
""")


def test_the_moe_gemm_compiles_for_hopper_in_every_form():
    lines = compile_script_output(COMPILE).split("\n")[:-1]
    assert len(lines) == 15 and "compiled fp8=1 a_fp8=1 swap=1 gate_up=1" in lines
    assert lines[-3:] == ["compiled quantize", "compiled sum", "compiled route"]
