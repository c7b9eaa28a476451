"""The router's kernel (kernels/triton_route.py) against the torch reference's softmax, top-k
and renormalisation, on the GPU or in Triton's interpreter (tests/gpu/numerics.py)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.numerics import kernel_device

RUNS_IN_TRITON_INTERPRETER = True
DEV = kernel_device()  # skips this module where kernels cannot run

from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels import triton_route  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (37, 128, 8), (300, 60, 4), (5, 8, 1), (3, 8, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_route_is_the_references(dtype, tokens, experts, top_k, renormalize):
    """The same k largest probabilities, in the same order, with their weights. bf16 logits tie
    often (8 bits of mantissa over 128 experts): there the ids may differ from torch's top-k,
    whose order among equals is unspecified, but each must be an expert of that probability."""
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype).to(DEV)
    weights, ids = triton_route.moe_route(logits, top_k, renormalize)
    want_weights, want_ids = ref.moe_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    chosen, best = probs.gather(1, ids.long()), probs.topk(top_k, dim=-1).values
    torch.testing.assert_close(chosen, best, rtol=1e-6, atol=0)  # a top k, in descending order
    assert all(len(set(row)) == top_k for row in ids.tolist())  # k distinct experts a token
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # fp32 sums in another order; then one bf16 rounding
    torch.testing.assert_close(weights.float(), want_weights.float(), rtol=tol, atol=tol)


def test_a_strided_router_output_and_ties():
    """The logits of a wider matmul's columns (a stride of its own), and equal probabilities:
    the lower expert id first, as the k-th pick takes the first of the largest."""
    wide = torch.zeros(4, 40, device=DEV)
    wide[:, :16] = torch.tensor([0.5, 2.0, 2.0, -1.0] * 4, device=DEV)
    weights, ids = triton_route.moe_route(wide[:, :16], 3, True)
    assert ids.tolist() == [[1, 2, 5]] * 4
    torch.testing.assert_close(weights, torch.full((4, 3), 1 / 3, device=DEV))


def test_top_k_names_its_limit():
    with pytest.raises(ValueError, match=r"top_k must be in 1\.\.8 \(the router's experts\), got 9"):
        triton_route.moe_route(torch.zeros(2, 8, device=DEV), 9, True)
