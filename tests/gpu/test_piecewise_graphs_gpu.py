"""Piecewise CUDA graphs on a GPU (engine/piecewise_graphs.py): the graphs are captured at the
engine's start (by Bullet's prefill worker on each of its partitions), replayed for chunked
mode's mixed steps and the prefill worker's steps, and give the tokens the eager steps
give (float32) and hidden states within bfloat16's rounding of the eager forward. Their speed:
`bullet-trt bench mixed-step`."""
from __future__ import annotations

import torch

from bullet_trt.config import load_engine_config
from bullet_trt.engine.piecewise_graphs import PiecewiseGraphs
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.shared_state import build_shared_state
from bullet_trt.serving.llm import LLM
from bullet_trt.tools.build import build_from_checkpoint
from tests.checkpoints import make_variant
from tests.gpu.numerics import rel_err
from tests.test_engine import prompts
from tests.test_piecewise_graphs import mixed_batch

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(tmp_path, variant: str, dtype: str):
    return build_from_checkpoint(make_variant(tmp_path / "ckpt", variant), tmp_path / "engine",
                                 max_model_len=256, dtype=dtype)


def test_chunked_mode_replays_the_graphs_and_generates_the_eager_tokens(tmp_path):
    e = engine(tmp_path, "llama", "float32")
    batch = prompts(6, seed=11)
    chunked = {"device": "cuda", "serve.mode": "chunked", "serve.chunk_size": 24}
    with LLM(str(e), **chunked) as llm:
        eager = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
    with LLM(str(e), **chunked, **{"prefill.piecewise_graph_tokens": "[16, 32, 64]"}) as llm:
        graphs = llm.engine.session.piecewise
        assert graphs.capture and len(graphs.pieces) == 3  # every bucket captured at start
        assert all(isinstance(p, torch.cuda.CUDAGraph) for pieces in graphs.pieces.values() for p in pieces)
        graphed = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
    assert graphed == eager


def test_the_bullet_prefill_worker_captures_every_partition_and_generates_the_eager_tokens(tmp_path):
    e = engine(tmp_path, "llama", "float32")
    batch = prompts(6, seed=11)
    bullet = {"device": "cuda", "serve.mode": "bullet"}
    with LLM(str(e), **bullet) as llm:
        eager = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
    with LLM(str(e), **bullet, **{"prefill.piecewise_graph_tokens": "[16, 64, 256]"}) as llm:
        partitions = len(llm.engine.splits) + 1  # every split's prefill partition, and the whole GPU
        ready = llm.engine.prefill.piecewise
        graphed = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        stats = llm.engine.stats()
    assert partitions > 2 and ready == {16: partitions, 64: partitions, 256: partitions}
    assert graphed == eager
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_graphed_hidden_states_match_the_eager_forward_in_bfloat16(tmp_path):
    for variant in ("qwen3", "qwen3_moe"):
        cfg = load_engine_config(engine(tmp_path / variant, variant, "bfloat16"),
                                 {"device": "cuda", "kv.num_blocks": "16"})
        state, model = build_shared_state(cfg, share=False)
        state.kv_pool.normal_()
        ids, positions, meta = mixed_batch(state.block_size, state.kv_pool.device)
        ids, positions = ids.cuda(), positions.cuda()
        eager_pool = state.kv_pool.clone()
        with torch.inference_mode():
            expected = model(ids, positions, eager_pool, meta)
            graphs = PiecewiseGraphs(model, state.kv_pool, [32, 64])
            graphs.capture_all()
            got = graphs.run(ids, positions, meta).clone()
        assert rel_err(got, expected) < 1e-2, variant
        assert rel_err(state.kv_pool, eager_pool) < 1e-2, variant
        assert torch.equal(state.kv_pool[:, :, 4:], eager_pool[:, :, 4:])  # no padded row wrote


def test_the_mixed_step_bench_times_the_hosts_launch_apart(tmp_path):
    """`bench mixed-step` on a small engine: each step's eager and graphed times, and the host's
    time to queue the graphed step without waiting for it and the step's time on the device
    alone, in the result and its table; the decode graph at the same rows beside them."""
    from bullet_trt.tools.bench.mixed_step import markdown, measure

    e = engine(tmp_path, "llama", "bfloat16")
    result = measure(str(e), chunks=[32], decode_rows=[0, 8], ctx=24, profile_host=True)
    assert [(r["chunk"], r["decode_rows"]) for r in result["steps"]] == [(32, 0), (32, 8)]
    for row in result["steps"]:
        assert 0 < row["graphed_launch_ms"] and 0 < row["graphed_ms"] and 0 < row["eager_ms"]
        assert 0 < row["graphed_device_ms"]
        host = row["host_profile"]
        names = [ev["name"] for ev in host["events"]]
        assert any(n.startswith(("cuda", "cu")) for n in names), names  # the launches' runtime calls
        assert all(ev["calls"] > 0 and ev["self_ms"] > 0 for ev in host["events"])
        assert 0 < host["events_ms"] and 0 < host["profiled_ms"] and 0 < host["outside_events_ms"]
    table = markdown(result)
    assert "graphed ms on the device alone" in table and "graphed launch ms (host)" in table and "| host event | calls | own ms |" in table
    # the decode worker's own graph at the same rows, and the mixed step against it and its chunk alone
    [graph] = result["decode_graph"]
    assert graph["decode_rows"] == 8 and graph["bucket"] == 8
    assert 0 < graph["graphed_ms"] and 0 < graph["launch_ms"] and 0 < graph["device_ms"]
    [parts] = result["fused_against_parts"]
    assert (parts["chunk"], parts["decode_rows"]) == (32, 8) and parts["decode_graph_ms"] == graph["device_ms"]
    assert parts["prefill_alone_ms"] == result["steps"][0]["graphed_device_ms"] and parts["over_parts"] > 0
    assert "the decode worker's own step" in table and "fused against its parts" in table
