"""Prefix caching (kv.prefix_caching) on a GPU: the chunked engine (plain and one ahead, with its
decode graphs and piecewise prefill graphs) and the bullet engine (two MPS clients on green
partitions) give the tokens they give without it, while a second wave of prompts takes the
blocks the first left. tests/test_prefix_cache.py checks the same on CPU; here the cached
blocks are written and read by the GPU kernels, across the two workers in bullet mode.

    bash scripts/gpu_run.sh tests tests/gpu/test_prefix_cache_gpu.py
"""
from __future__ import annotations

import pytest

from bullet_trt import LLM, SamplingParams
from bullet_trt.tools.build import build_from_checkpoint
from tests.checkpoints import VOCAB_SIZE

SHARED = [(37 * i) % (VOCAB_SIZE - 3) + 3 for i in range(70)]  # the prefix every prompt opens with

LOOPS = {
    "chunked": {"serve.mode": "chunked", "prefill.piecewise_graph_tokens": "[64,128,256]"},
    "chunked-ahead": {"serve.mode": "chunked", "decode.overlap_steps": True},
    "bullet": {"serve.mode": "bullet", "serve.partitioner": "green"},
}


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    # fp32: tokens must match exactly with and without the cache
    return build_from_checkpoint(checkpoint("llama"), tmp_path_factory.mktemp("prefix") / "engine",
                                 max_model_len=256, dtype="float32")


def waves(engine, **overrides):
    """Two waves of four prompts that open with SHARED; the second finds the first's blocks."""
    out = []
    with LLM(str(engine), **overrides) as llm:
        for wave in range(2):
            prompts = [SHARED[:40 + 9 * i] + [(wave * 101 + 13 * i + j) % (VOCAB_SIZE - 3) + 3 for j in range(11)]
                       for i in range(4)]
            params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                      SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)] * 2
            out += [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        return out, llm.engine.stats()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_cached_prefixes_give_the_same_tokens_on_the_gpu(request, engine, loop):
    if loop == "bullet":
        request.getfixturevalue("mps_daemon")
    common = {**LOOPS[loop], "kv.block_size": 16, "kv.num_blocks": 256}
    want, _ = waves(engine, **common)
    got, stats = waves(engine, **common, **{"kv.prefix_caching": True})
    assert got == want
    assert stats.prefix_cache_hit_tokens >= 4 * 32  # the second wave found at least two shared blocks each
    assert stats.kv_blocks_cached > 0 and stats.kv_blocks_free == stats.kv_blocks_total
