"""Piecewise graphs for steps with prompt tokens (engine/piecewise_graphs.py), checked on CPU
without graphs: the pieces over their padded static buffers give the hidden states and KV
cache of the plain forward, for dense and MoE layers, and a chunked engine using them
generates the tokens it generates without them, as does Bullet's prefill worker. Captured
graphs: tests/gpu/test_piecewise_graphs_gpu.py."""
from __future__ import annotations

import pytest
import torch

from bullet_trt.config import load_engine_config
from bullet_trt.engine.piecewise_graphs import PiecewiseGraphs
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.kernels.metadata import AttentionMetadata
from bullet_trt.model.transformer import SparseMoeBlock
from bullet_trt.serving.llm import LLM
from tests.test_engine import engine_dir_for, prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def engine(request, tmp_path_factory):
    return engine_dir_for(tmp_path_factory, request.param)[0]


def mixed_batch(block_size: int, device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A prompt's first 13 tokens, one decode token at position 20 of a cached sequence and a
    7-token chunk of a prompt whose first 5 tokens are cached: 21 tokens."""
    g = torch.Generator().manual_seed(3)
    q_lens, seq_lens = [13, 1, 7], [13, 21, 12]
    tables = [[0], [1, 2], [3]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device)
    ids = torch.randint(3, 200, (sum(q_lens),), generator=g)
    positions = torch.tensor([p for q, s in zip(q_lens, seq_lens) for p in range(s - q, s)])
    return ids, positions, meta


def test_the_pieces_give_the_forwards_hidden_states_and_kv_cache(engine):
    cfg = load_engine_config(engine, {"kv.num_blocks": "16"})
    state, model = build_shared_state(cfg, share=False)
    state.kv_pool.normal_()  # the cached tokens the decode row and the second chunk attend to
    ids, positions, meta = mixed_batch(state.block_size, state.kv_pool.device)
    plain_pool = state.kv_pool.clone()
    with torch.inference_mode():
        expected = model(ids, positions, plain_pool, meta)
        pieces = PiecewiseGraphs(model, state.kv_pool, [8, 32], capture=False)
        assert pieces.bucket(21) == 32 and pieces.bucket(33) is None
        got = pieces.run(ids, positions, meta).clone()
        written = state.kv_pool.clone()
        # a second, shorter step through the same buffers: nothing of the first leaks in
        again = pieces.run(ids[:13], positions[:13], AttentionMetadata.build([13], [13], [[0]], state.block_size,
                                                                            state.kv_pool.device)).clone()
    assert got.shape == expected.shape == (21, model.arch.hidden_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, expected[:13], rtol=1e-5, atol=1e-5)
    # the same K/V written (grouped expert GEMMs over 32 padded rows round like 21 rows only
    # to within float32 noise), and nothing outside the batch's blocks 0-3: no padded row wrote
    torch.testing.assert_close(written, plain_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(written[:, :, 4:], plain_pool[:, :, 4:])
    assert set(pieces.pieces) == {(0, 32)}


def test_an_moe_layer_sends_the_padded_rows_to_no_expert(engine):
    """21 tokens in the 32 bucket: every MoE layer's output is zero on the 11 padded rows (their
    assignments left out of the grouped GEMM) and the real rows' hidden states are the forward's."""
    cfg = load_engine_config(engine, {"kv.num_blocks": "16"})
    state, model = build_shared_state(cfg, share=False)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks:
        pytest.skip("a dense model: its MLP costs padded rows the same either way")
    state.kv_pool.normal_()
    ids, positions, meta = mixed_batch(state.block_size, state.kv_pool.device)
    outputs = []
    with torch.inference_mode():
        expected = model(ids, positions, state.kv_pool.clone(), meta)
        hooks = [b.register_forward_hook(lambda _m, _a, out: outputs.append(out.clone())) for b in blocks]
        pieces = PiecewiseGraphs(model, state.kv_pool, [32], capture=False)
        got = pieces.run(ids, positions, meta).clone()
        for hook in hooks:
            hook.remove()
    assert len(outputs) == len(blocks)
    for out in outputs:
        assert out.shape[0] == 32 and torch.count_nonzero(out[21:]) == 0 and torch.count_nonzero(out[:21]) > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # routed, the padded rows would have gone to experts like any other row
    x = torch.randn(4, model.arch.hidden_size, dtype=model.dtype)
    assert torch.count_nonzero(blocks[0](model.ops, x)[2:]) > 0
    assert torch.count_nonzero(blocks[0](model.ops, x, torch.tensor([2]))[2:]) == 0


def test_a_chunked_engine_with_piecewise_pieces_generates_the_same_tokens(engine):
    batch = prompts(6, seed=11)
    chunked = {"serve.mode": "chunked", "serve.chunk_size": 24}
    with LLM(str(engine), **chunked) as llm:
        eager = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
    # 16 and 32 cover some steps; the larger ones (up to the chunk plus decode rows) run eagerly
    with LLM(str(engine), **chunked, **{"prefill.piecewise_graph_tokens": "[16, 32]"}) as llm:
        pieces = llm.engine.session.piecewise
        assert pieces is not None and not pieces.capture and {b for _, b in pieces.pieces} == {16, 32}
        steps, run = [], pieces.run
        pieces.run = lambda ids, *rest: (steps.append(ids.shape[0]), run(ids, *rest))[1]
        pieced = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        stats = llm.engine.stats()
    assert pieced == eager
    assert steps and max(steps) <= 32 and any(n > 16 for n in steps)  # both buckets served steps
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_the_bullet_prefill_worker_runs_its_prompts_through_the_pieces(engine):
    """The bullet prefill worker, a process of its own, builds the pieces at start (each
    partition's on a GPU; the CPU has one) and generates what it generates eagerly."""
    batch = prompts(6, seed=13)
    bullet = {"serve.mode": "bullet"}
    with LLM(str(engine), **bullet) as llm:
        eager = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        assert llm.engine.prefill.piecewise == {}
    # six prompts of under 60 tokens: 384 holds any prefill batch of them, so every prompt
    # went through the pieces
    with LLM(str(engine), **bullet, **{"prefill.piecewise_graph_tokens": "[16, 384]"}) as llm:
        pieced = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        ready = (llm.engine.prefill.piecewise, llm.engine.decode.piecewise)
        stats = llm.engine.stats()
    assert ready == ({16: 1, 384: 1}, {})  # the decode worker's steps are its own graphs
    assert pieced == eager
    assert stats.kv_blocks_free == stats.kv_blocks_total
