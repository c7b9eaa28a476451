"""The paged attention kernels over an FP8 cache compile for Hopper (sm_90) on any machine, and
the decode loop reads V as the layout intends (kernels/fp8_kv.py): 16-byte asynchronous copies,
no byte-wide loads of the product's operand from shared memory, and a loop of fewer than 900
instructions for its 32 KB of K and V (1162 with V read across its slots; the bf16 cache's 372).
tests/hopper_compile.py says why in a process of its own."""
from __future__ import annotations

import textwrap

import pytest

from tests.hopper_compile import compile_script_output

pytest.importorskip("triton")

COMPILE = textwrap.dedent("""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bullet_trt.kernels import triton_ops as tops

    def compiled(fn, sig, consts, num_warps, num_stages, not_specialized=()):
        # what a launch specializes: pointers and the integers Triton may, as dividing by 16
        index = {name: (fn.arg_names.index(name),) for name in fn.arg_names}
        attrs = {index[name]: [["tt.divisibility", 16]] for name, kind in sig.items()
                 if kind.startswith("*") or (kind == "i32" and name not in fn.do_not_specialize
                                             and name not in not_specialized)}
        sig = {**sig, **{name: "constexpr" for name in consts}}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs={index[k]: v for k, v in consts.items()},
                                        attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                         "num_stages": num_stages})

    def loop_instructions(ptx):
        # the body of the kernel's backward branch: its loop over the keys
        lines = ptx.splitlines()
        branch = next(i for i, line in enumerate(lines) if re.search(r"bra(\\.uni)?\\s+\\$L__BB0_2;", line))
        start = next(i for i, line in enumerate(lines) if line.startswith("$L__BB0_2:"))
        body = [line.strip() for line in lines[start + 1:branch]]
        return [line for line in body if line and not line.startswith(("$", "//", "{", "}", ".loc", ".reg"))]

    fn = tops._decode_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(Q="*bf16", CU="*i32", SEQ_LENS="*i32", BT="*i32", O="*bf16", MID_O="*fp32", MID_LSE="*fp32",
               qk_scale="fp32")
    # Qwen3-30B-A3B's heads, each cache at its shipped tile (32 KB of K and V a loop either way)
    for cache, inner in (("bf16", False), ("fp8e4nv", False), ("fp8e4nv", True)):
        fp8 = cache == "fp8e4nv"
        cfg = dict(tops.DECODE_CONFIGS_FP8_CACHE[False] if fp8 else tops.DECODE_CONFIGS[(False, False)])
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        consts = dict(HQ=32, G=8, G_PAD=16, D=128, BLOCK_D=128, BLOCK_SIZE=16, DIRECT=False, DOT_PREC="tf32",
                      UPCAST=False, DOT_FP16=fp8, V_SLOTS_INNER=inner, **cfg)
        ptx = compiled(fn, {**sig, "KV": "*" + cache}, consts, warps, stages,
                       not_specialized=("num_splits",)).asm["ptx"]
        loop = loop_instructions(ptx)
        byte_loads = sum("ld.shared.b8" in line for line in loop)
        print(f"decode cache={cache} slots_inner={inner} loop={len(loop)} byte_loads={byte_loads} "
              f"async16={'cp.async.cg.shared.global' in ptx}")
    fn = tops._prefill_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(Q="*bf16", KV="*fp8e4nv", CU="*i32", SEQ_LENS="*i32", BT="*i32", O="*bf16", qk_scale="fp32")
    cfg = dict(tops.PREFILL_CONFIGS[(False, False)])
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    consts = dict(G=8, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_B=16, SKIP_SINGLE=True, DOT_PREC="tf32",
                  UPCAST=False, V_SLOTS_INNER=True, **cfg)
    assert compiled(fn, sig, consts, warps, stages).asm["cubin"]
    print("prefill compiled")
""")


def loop_counts() -> list[dict]:
    """Each decode form's loop as compiled for sm_90: its instructions, byte-wide shared loads and
    whether it copies 16 bytes at a time (also what docs/benchmarks.md, thirtieth round, quotes:
    ``python -c "from tests.test_attention_kernels_compile import loop_counts; print(loop_counts())"``)."""
    lines = compile_script_output(COMPILE).split("\n")[:-1]
    assert lines[3] == "prefill compiled"
    return [dict(field.split("=") for field in line.split()[1:]) for line in lines[:3]]


def test_the_fp8_decode_loop_reads_v_with_its_keys_adjacent():
    bf16, across, inner = loop_counts()
    assert int(across["byte_loads"]) > 0  # the layout before: V's operand assembled a byte at a time
    assert inner["byte_loads"] == "0" and inner["async16"] == "True"
    assert int(inner["loop"]) < 900 < int(across["loop"])
    assert int(inner["loop"]) < 2.5 * int(bf16["loop"])  # per byte moved, within 2.5x of bf16's loop
