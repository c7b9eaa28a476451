"""The seeded categorical draw as a Triton kernel (kernels/triton_sample.py) picks the tokens the
torch reference (kernels/reference.gumbel_argmax) picks, row for row: the same hash, the same
float64 noise, the same first index on a tie. On a GPU at Llama 3's vocabulary; without one in
Triton's interpreter (TRITON_INTERPRET=1) on smaller rows."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.numerics import CUDA, kernel_device

RUNS_IN_TRITON_INTERPRETER = True  # tests/gpu/conftest.py runs this module on CPU then
DEV = kernel_device()

from bullet_trt.engine.sampling import row_keys  # noqa: E402
from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels import triton_sample  # noqa: E402

VOCAB = 128256 if CUDA else 2500  # not a multiple of the kernel's block


def keys_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**62, 2**62, (n,), generator=g)
    steps = torch.randint(0, 4000, (n,), generator=g)
    return row_keys(seeds, steps).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_draws_what_the_reference_draws(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(12, VOCAB, generator=g) * 4).to(dtype).to(DEV)
    logits[3, ::7] = float("-inf")  # banned tokens, as sampling sets them
    rows = torch.tensor([0, 3, 5, 6, 11, 2], device=DEV)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.05, 2.0, 1e-5], device=DEV)
    keys = keys_for(rows.shape[0], 2)
    got = triton_sample.gumbel_argmax(logits, rows, temperature, keys)
    want = ref.gumbel_argmax(logits, rows, temperature, keys)
    assert got.tolist() == want.tolist()
    assert all(logits[r, t] > float("-inf") for r, t in zip(rows.tolist(), got.tolist()))


def test_ties_go_to_the_noise_then_to_the_first_index():
    flat = torch.zeros(2, VOCAB, device=DEV)  # every token equally likely: the noise decides
    rows = torch.tensor([0, 1, 0], device=DEV)
    keys = keys_for(3, 3)
    got = triton_sample.gumbel_argmax(flat, rows, torch.ones(3, device=DEV), keys)
    assert got.tolist() == ref.gumbel_argmax(flat, rows, torch.ones(3, device=DEV), keys).tolist()
    assert len(set(got.tolist())) > 1  # different keys, different draws
    banned = torch.full((1, VOCAB), float("-inf"), device=DEV)
    one = torch.tensor([0], device=DEV)
    assert triton_sample.gumbel_argmax(banned, one, torch.ones(1, device=DEV), keys[:1]).tolist() == [0]


def test_no_rows_no_launch():
    out = triton_sample.gumbel_argmax(torch.zeros(2, VOCAB, device=DEV), torch.empty(0, dtype=torch.int64, device=DEV),
                                      torch.empty(0, device=DEV), torch.empty(0, dtype=torch.int64, device=DEV))
    assert out.shape == (0,)


def test_the_nucleus_tail_kernel_draws_what_sorting_the_whole_row_draws(monkeypatch):
    """Rows whose top-p nucleus reaches past their candidates: the kernel (a threshold found by
    bisection, no sort, nothing read on the host) keeps the tokens the whole-row sort keeps and
    draws the same one; rows the candidates settle are left as they were drawn."""
    from types import SimpleNamespace

    from bullet_trt.engine import sampling

    g = torch.Generator().manual_seed(5)
    peaked = torch.randn(3, VOCAB, generator=g) * 6  # nuclei of a few tokens: settled by 16 candidates
    flat = torch.randn(5, VOCAB, generator=g) * 0.3  # nuclei of most of the row
    logits = torch.cat([peaked, flat]).to(DEV)
    logits[4, ::5] = float("-inf")  # banned tokens, as sampling sets them
    temperature = torch.tensor([1.0, 0.7, 1.2, 1.0, 0.9, 1.5, 0.6, 1.0], device=DEV)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.9, 0.99, 0.5, 0.8, 0.999], device=DEV)
    top_k = torch.zeros(8, dtype=torch.int64, device=DEV)
    monkeypatch.setattr(sampling, "CANDIDATES", 16)
    kernel = SimpleNamespace(nucleus_tail_draw=triton_sample.nucleus_tail_draw)
    for step in range(6):
        keys = keys_for(8, 10 + step)
        got = sampling._draw_filtered(logits, temperature, top_k, top_p, keys, 0, True, kernel)
        want = sampling._draw_filtered(logits, temperature, top_k, top_p, keys, 0, True, ref)
        assert got.tolist() == want.tolist()
    vals, _ = (logits / temperature.unsqueeze(1)).topk(16, dim=-1)
    _, complete, _ = sampling._kept(logits, temperature, vals, top_k, top_p)
    assert complete[:3].all() and not complete[3:].any()  # both kinds of rows were drawn
