"""The sampler's draw: Gumbel-max over logits / T with hashed noise picks each token with its
softmax probability, a seeded row draws the same token whatever shares its batch, and top-k /
top-p rows draw only inside their kept set (engine/sampling.py, kernels/reference.py)."""
from __future__ import annotations

import torch

from bullet_trt.engine.sampling import SamplingBatch, SamplingParams, row_keys, sample
from bullet_trt.kernels import reference


def test_tokens_come_with_their_softmax_probability():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0]])
    temperature = 0.8
    n = 4000
    keys = row_keys(torch.full((n,), 12345), torch.arange(n))  # one request's first n tokens
    tokens = reference.gumbel_argmax(logits, torch.zeros(n, dtype=torch.int64), torch.full((n,), temperature), keys)
    freq = torch.bincount(tokens, minlength=5).float() / n
    want = torch.softmax(logits[0] / temperature, dim=-1)
    # a binomial's standard deviation here is at most 0.008: 0.03 is about four of them
    assert (freq - want).abs().max() < 0.03, (freq, want)


def params_batch(params: list[SamplingParams], steps: list[int]) -> SamplingBatch:
    return SamplingBatch.build(params, steps, [[] for _ in params], "cpu")


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 2
    mine = SamplingParams(temperature=0.9, seed=77)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=20, seed=5),
              SamplingParams(temperature=0.6, top_p=0.8, seed=6)]
    alone, _ = sample(logits[:1].clone(), params_batch([mine], [3]))
    together, _ = sample(logits.clone(), params_batch([mine, *others], [3, 0, 1, 2]))
    assert together[0] == alone[0]
    assert together[1] == logits[1].argmax()  # the greedy row


def test_top_k_and_top_p_rows_draw_inside_their_kept_set():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 200, generator=g) * 3
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.6].tolist())
    drawn_k, drawn_p = set(), set()
    for step in range(200):
        k_tok, _ = sample(logits.clone(), params_batch([SamplingParams(temperature=1.0, top_k=5, seed=9)], [step]))
        p_tok, _ = sample(logits.clone(), params_batch([SamplingParams(temperature=1.0, top_p=0.6, seed=9)], [step]))
        drawn_k.add(int(k_tok))
        drawn_p.add(int(p_tok))
    assert drawn_k <= top5 and drawn_p <= nucleus
    assert len(drawn_k) >= 3 and len(drawn_p) >= min(3, len(nucleus))  # draws, not the argmax


def test_candidates_settle_what_sorting_the_whole_row_would(monkeypatch):
    """Kept tokens found among a row's largest logits, or by sorting the whole row when its
    nucleus reaches past them, draw exactly what whole-row sorting draws."""
    from bullet_trt.engine import sampling
    g = torch.Generator().manual_seed(4)
    peaked = torch.randn(3, 500, generator=g) * 6  # the nucleus at 0.5: a handful of tokens
    flat = torch.randn(3, 500, generator=g) * 0.1  # the nucleus at 0.99: most of the row
    logits = torch.cat([peaked, flat])
    params = ([SamplingParams(temperature=1.0, top_p=0.5, seed=i) for i in range(3)]
              + [SamplingParams(temperature=0.9, top_p=0.99, seed=i) for i in range(3, 5)]
              + [SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=5)])  # k wider than 8

    def draws(candidates: int) -> list[list[int]]:
        monkeypatch.setattr(sampling, "CANDIDATES", candidates)
        return [sample(logits.clone(), params_batch(params, [step] * 6))[0].tolist() for step in range(40)]

    assert draws(8) == draws(500)
    # the flat rows' nuclei do not fit 8 candidates: those rows took the whole-row sort
    vals, _ = flat.topk(8, dim=-1)
    _, complete, _ = sampling._kept(flat, torch.ones(3), vals, torch.zeros(3, dtype=torch.int64), torch.full((3,), 0.99))
    assert not complete.any()


def test_rows_that_all_have_a_top_k_are_settled_by_their_candidates(monkeypatch):
    """A batch whose filtered rows all have a top-k skips the check whether a nucleus reached
    past the candidates (a wait for the device on a GPU) and the whole rows' normalizer: its
    draws are the whole-row sort's. One row of top-p alone brings the check back."""
    from bullet_trt.engine import sampling
    g = torch.Generator().manual_seed(9)
    logits = torch.cat([torch.randn(3, 500, generator=g) * 6, torch.randn(3, 500, generator=g) * 0.1])
    top_k = [SamplingParams(temperature=0.9, top_k=k, top_p=p, seed=i)
             for i, (k, p) in enumerate([(5, 1.0), (40, 0.9), (8, 0.5), (300, 0.99), (20, 1.0), (120, 0.95)])]
    assert not params_batch(top_k, [0] * 6).nucleus_unbounded
    assert params_batch(top_k[:5] + [SamplingParams(temperature=0.9, top_p=0.9, seed=5)], [0] * 6).nucleus_unbounded

    def draws(candidates: int) -> list[list[int]]:
        monkeypatch.setattr(sampling, "CANDIDATES", candidates)
        return [sample(logits.clone(), params_batch(top_k, [step] * 6))[0].tolist() for step in range(30)]

    assert draws(8) == draws(500)  # candidates 300 wide (the widest top-k) against the whole 500
