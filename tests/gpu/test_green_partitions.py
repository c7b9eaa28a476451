"""Work on green-context partitions gives the whole GPU's answers.

cuBLAS sizes its grids for the device's SM count, also on a partition, and its matrix-vector
products failed outright (CUBLAS_STATUS_EXECUTION_FAILED) on the 12- and 4-SM remainders of an
H200; serve.min_phase_sms keeps both phases at 16 SMs or more for that reason. So every split
the spatial modes may use is run here, on both sides, with the projection GEMMs of
Llama-3.1-8B at decode and prefill row counts, under torch's default cuBLAS and under what the
engine runs (cuBLASLt told the partition's SM count through set_num_sms). Results are compared
with an fp32 reference computed on the whole GPU. Disjointness of the two sides (SM ids in one
process, throughput across two MPS clients) is tests/test_sm.py's; the speed of each BLAS
setting on partitions is `bullet-trt bench kernels --compare-blas`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bullet_trt.config import ServeConfig
from tests.gpu.numerics import rel_err

# (name, K, N): q/k/v and gate/up fused, as the engine runs them
GEMMS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
         ("lm_head", 4096, 128256))
ROWS = (1, 3, 16, 224)  # decode GEMVs (the failing case), small and large decode batches
BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def operands():
    """bf16 inputs and fp32 products on the whole GPU, made once."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, k, n in GEMMS:
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            out.append((f"{name} M={m}", x, w, x.float() @ w.float().t()))
    return out


@pytest.fixture
def blas_setting():
    """Puts torch's BLAS back as the test found it: the library is process-wide."""
    from bullet_trt.kernels import triton_ops

    before = torch.backends.cuda.preferred_blas_library()
    yield triton_ops
    triton_ops.set_num_sms(None)
    torch.backends.cuda.preferred_blas_library(before)


def engine_splits(part) -> list[int]:
    low = ServeConfig().min_phase_sms
    return [s for s in part.splits() if s >= low and part.total_sms - s >= low]


@pytest.mark.parametrize("setting", ["cublas", "cublaslt+sm_target"])
def test_every_split_runs_the_projection_gemms_on_both_sides(green, operands, blas_setting, setting):
    prefill, decode = green("prefill", []), green("decode", [])
    splits = engine_splits(prefill)
    assert splits, f"no split of {prefill.total_sms} SMs leaves both phases {ServeConfig().min_phase_sms}"
    prefill.prepare("prefill", splits)
    decode.prepare("decode", splits)
    torch.backends.cuda.preferred_blas_library("cublas" if setting == "cublas" else "cublaslt")
    torch.cuda.synchronize()
    failures = []
    for s in splits:
        for part, role in ((prefill, "prefill"), (decode, "decode")):
            sms = part.actual_sms(s)[0 if role == "prefill" else 1]
            blas_setting.set_num_sms(sms if setting.endswith("sm_target") else None)
            stream = part.stream(s)
            for what, x, w, want in operands:
                try:
                    with torch.cuda.stream(stream):
                        got = F.linear(x, w)
                    stream.synchronize()
                    err = rel_err(got, want)
                except RuntimeError as e:  # a cuBLAS failure: record it, keep the stream usable
                    torch.cuda.synchronize()
                    failures.append(f"split {s} {role} ({sms} SMs) {what}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if err > BF16_TOL:
                    failures.append(f"split {s} {role} ({sms} SMs) {what}: rel_err {err:.2e}")
    assert not failures, "\n".join(failures[:20])


def test_elementwise_work_on_every_side_writes_every_element(green):
    prefill, decode = green("prefill", []), green("decode", [])
    splits = engine_splits(prefill)
    prefill.prepare("prefill", splits)
    decode.prepare("decode", splits)
    x = torch.randn(1 << 24, device="cuda")
    want = x * 3.0 + 1.0
    for s in splits:
        for part in (prefill, decode):
            out = torch.full_like(x, float("nan"))
            stream = part.stream(s)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.add(x * 3.0, 1.0, out=out)
            stream.synchronize()
            assert torch.equal(out, want), f"split {s} {part.role}"


def test_set_num_sms_tells_cublaslt_the_partition_size(blas_setting):
    """The engine's GEMMs plan for the SMs of their partition: set_num_sms(n) leaves the rest
    to others as cuBLASLt's SM carve-out (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET)."""
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if get is None or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        pytest.skip("this torch has no cuBLASLt SM carve-out")
    total = torch.cuda.get_device_properties(0).multi_processor_count
    blas_setting.set_num_sms(32)
    assert get() == total - 32
    blas_setting.set_num_sms(total)
    assert get() is None
    blas_setting.set_num_sms(32)
    blas_setting.set_num_sms(None)
    assert get() is None
