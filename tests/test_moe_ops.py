"""The torch reference of the MoE ops (kernels/reference.py, the CPU path and the GPU kernels'
oracle): routing against transformers' Qwen3-MoE router, the sorted grouped computation
against a naive loop over every token's experts, and the expert-range seam."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bullet_trt.kernels import reference as ref


def naive_moe(x, w_gate_up, w_down, weights, ids):
    """Token by token, slot by slot: the definition, with no sorting or grouping."""
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = w_gate_up[e] @ x[t]
            out[t] += weights[t, slot] * (w_down[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def random_layer(tokens, hidden, inter, experts, top_k, seed=0, renormalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    weights, ids = ref.moe_route(torch.randn(tokens, experts, generator=g), top_k, renormalize)
    return x, w_gate_up, w_down, weights, ids


# one token; more experts than tokens (most get none); every expert for every token; a batch
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (3, 16, 4), (5, 4, 4), (33, 8, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_a_naive_loop(tokens, experts, top_k, renormalize):
    x, w_gate_up, w_down, weights, ids = random_layer(tokens, 24, 40, experts, top_k, renormalize=renormalize)
    got = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    want = naive_moe(x, w_gate_up, w_down, weights, ids)
    assert want.abs().max() > 0.1
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_expert_ranges_of_ranks_sum_to_the_whole_layer():
    """The seam for expert parallelism: a rank holding experts [lo, hi) adds exactly their
    share, so ranks holding a partition of the experts sum to the unsharded layer."""
    x, w_gate_up, w_down, weights, ids = random_layer(20, 24, 40, 16, 4, seed=3)
    whole = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    cuts = [0, 5, 11, 16]
    parts = [ref.fused_moe(x, w_gate_up[lo:hi], w_down[lo:hi], weights, ids, expert_offset=lo)
             for lo, hi in zip(cuts, cuts[1:])]
    assert all(p.abs().max() > 0 for p in parts)
    assert torch.allclose(sum(parts), whole, atol=1e-5, rtol=1e-5)
    # a rank's share is the naive loop over the assignments that fall in its range
    lo, hi = cuts[1], cuts[2]
    inside = (ids >= lo) & (ids < hi)
    share = naive_moe(x, w_gate_up, w_down, torch.where(inside, weights, 0.0), ids)
    assert torch.allclose(parts[1], share, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers_router(renormalize):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                      norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        x = torch.randn(9, 32, generator=g)
        _, want_weights, want_ids = router(x)
    weights, ids = ref.moe_route(F.linear(x, router.weight.detach()), 4, renormalize)
    assert torch.equal(ids.long(), want_ids) and torch.allclose(weights, want_weights, atol=1e-6)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(9)) if renormalize else bool((sums < 1).all())
