"""Tensor parallelism on two GPUs: one process per rank, rank r on cuda:r, NCCL for the model's
collectives. What tests/test_tensor_parallel.py checks over gloo on CPU, here on the GPU
kernels and NCCL, and on the Llama-3.1-8B shape. Skipped with fewer than two GPUs; on a
machine of two:

    bash scripts/gpu_run.sh tests tests/gpu/test_tensor_parallel_gpu.py

(gpu_run.sh exports NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1, and every rank
sets them again before NCCL starts). Tokens must match exactly, so the models run in float32:
in bf16 the ranks' partial sums add up in another order than one GPU's GEMM, and random
weights leave near ties that such a difference flips. Decode runs eager under tensor
parallelism unless `parallel.decode_graphs` captures the NCCL collectives into its CUDA graphs
(the last tests), against one GPU's graphs.
"""
from __future__ import annotations

import random

import pytest
import torch

from bullet_trt import LLM, SamplingParams
from bullet_trt.tools.build import build_dummy_engine, build_from_checkpoint
from tests.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

TP2 = {"parallel.tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            made[variant] = build_from_checkpoint(checkpoint(variant), tmp_path_factory.mktemp(variant) / "engine",
                                                  max_model_len=256, dtype="float32")
        return made[variant]
    return get


def workload(n: int, vocab: int, lengths: tuple[int, int], seed: int = 3):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 32), temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)] * (n // 2)
    return prompts, params


def tokens(engine, prompts, params, **overrides):
    with LLM(str(engine), **overrides) as llm:
        out = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        return out, llm.engine.stats()


@pytest.mark.parametrize("variant", ["llama", "llama-1kv", "qwen3_moe"])
def test_two_gpus_give_the_tokens_of_one(engines, variant):
    prompts, params = workload(12, VOCAB_SIZE, (9, 120))
    common = {"serve.mode": "chunked", "kv.num_blocks": 512}
    want, _ = tokens(engines(variant), prompts, params, **common)
    got, stats = tokens(engines(variant), prompts, params, **common, **TP2)
    assert got == want
    assert stats.kv_blocks_free_by_rank == (512, 512)


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager", "decode_graphs"])
@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_bullet_on_two_gpus_gives_the_tokens_of_one(mps_daemon, engines, variant, decode_graphs):
    """Each GPU's prefill and decode workers (MPS clients on its green partitions) run what
    rank 0's take, on the same split; with `parallel.decode_graphs` each decode worker
    captures a graph per partition and bucket, the collectives inside."""
    prompts, params = workload(12, VOCAB_SIZE, (9, 120))
    want, _ = tokens(engines(variant), prompts, params, **{"serve.mode": "chunked", "kv.num_blocks": 512})
    graphs = {"parallel.decode_graphs": decode_graphs}
    got, stats = tokens(engines(variant), prompts, params, **TP2, **graphs, **{
        "serve.mode": "bullet", "serve.partitioner": "green", "kv.num_blocks": 512})
    assert got == want
    assert stats.kv_blocks_free_by_rank == (512, 512)


def test_llama_8b_shape_on_two_gpus_gives_the_tokens_of_one(tmp_path):
    """Dummy weights of Llama-3.1-8B's shape: each rank draws every whole tensor from the seed
    and keeps its slice, so both runs hold the same model (8 KV heads, 4 a rank)."""
    engine = build_dummy_engine("llama-3.1-8b", tmp_path / "engine", 1024, seed=0)
    prompts, params = workload(8, 128000, (100, 600))
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)] * len(prompts)
    common = {"serve.mode": "chunked", "dtype": "float32", "kv.num_blocks": 512}
    want, _ = tokens(engine, prompts, params, **common)
    got, stats = tokens(engine, prompts, params, **common, **TP2)
    assert got == want
    assert stats.kv_blocks_free_by_rank == (512, 512)


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_decode_graphs_with_the_collectives_inside_give_the_tokens_of_one(engines, variant):
    """Every rank captures each decode bucket's graph, its all-reduces and the vocabulary's
    all-gather inside, and the pure decode steps replay them on both ranks in step."""
    prompts, params = workload(12, VOCAB_SIZE, (9, 120))
    common = {"serve.mode": "chunked", "kv.num_blocks": 512}
    want, _ = tokens(engines(variant), prompts, params, **common)
    with LLM(str(engines(variant)), **common, **TP2, **{"parallel.decode_graphs": True}) as llm:
        graphs = llm.engine.session.session.graphs  # rank 0's, under its LeaderSession
        assert graphs is not None and len(graphs.graphs) == len(graphs.batch_sizes)
        got = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        stats = llm.engine.stats()
    assert got == want
    assert stats.kv_blocks_free_by_rank == (512, 512)
