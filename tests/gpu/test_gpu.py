"""The engine core on a CUDA GPU: bf16 parity with transformers, the prefill and decode
workers sharing weights and pool through CUDA IPC, decode CUDA graphs, the KV pool's memory
budget. Skipped without a GPU (tests/gpu/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch

from bullet_trt import LLM, SamplingParams
from bullet_trt.kernels.metadata import AttentionMetadata
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.loader import load_checkpoint
from bullet_trt.model.transformer import CausalLM
from bullet_trt.tools.build import build_from_checkpoint
from tests.checkpoints import FAMILIES
from tests.gpu.numerics import rel_err

# bf16 keeps 8 bits of mantissa: logits of a model whose activations pass through a dozen
# bf16 roundings land within a few percent of the fp32 answer.
BF16_REL_TOL = 3e-2


def hf_logits(ckpt, ids: list[int], fp8_kv: bool = False) -> torch.Tensor:
    """transformers' fp32 logits (``fp8_kv``: its attention reading E4M3-rounded K/V)."""
    from transformers import AutoModelForCausalLM

    from tests.test_fp8_kv_cache import hf_rounded
    hf = hf_rounded(ckpt) if fp8_kv else AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_last_logits(ckpt, prompts: list[list[int]], block_size: int, dtype=torch.bfloat16,
                    fp8_experts: bool = False, fp8_activations: bool = False, kv_dtype=None) -> torch.Tensor:
    arch = ModelArch.from_checkpoint(ckpt)
    model = CausalLM(arch, dtype, "cuda", max_positions=512, fp8_experts=fp8_experts, fp8_activations=fp8_activations)
    load_checkpoint(model, ckpt, dtype)
    nb = sum(-(-len(p) // block_size) for p in prompts)
    pool = torch.zeros(arch.num_layers, 2, nb + 1, block_size, arch.num_kv_heads, arch.head_dim,
                       dtype=kv_dtype or dtype, device="cuda")
    tables, nxt = [], 1  # block 0 stays unused so a wrong table shows
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    meta = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], tables,
                                   block_size, "cuda")
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device="cuda")
    with torch.inference_mode():
        hidden = model(ids, pos, pool, meta)
        return model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1]).cpu()


def argmax_gaps(ckpt, prompt: list[int], tokens: list[int], fp8_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For each generated token, how far its fp32 reference logit lies below the reference's
    maximum, and the step's largest logit (the scale bf16 error goes by)."""
    logits = hf_logits(ckpt, prompt + tokens, fp8_kv)[len(prompt) - 1:-1]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return logits.max(dim=-1).values - chosen, logits.abs().max(dim=-1).values


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(torch.randint(9, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_match_transformers(checkpoint, family):
    ckpt = checkpoint(family)
    prompts = random_prompts(8, seed=3)
    refs = torch.stack([hf_logits(ckpt, p)[-1] for p in prompts])
    batched = our_last_logits(ckpt, prompts, block_size=16)
    assert rel_err(batched, refs) < BF16_REL_TOL
    # one sequence at a time with 32-token blocks (the Triton kernels take power-of-two block
    # sizes); the 9-70 token prompts end mid-block either way
    alone = torch.cat([our_last_logits(ckpt, [p], block_size=32) for p in prompts])
    assert rel_err(alone, refs) < BF16_REL_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_tokens_are_argmax_within_tolerance(checkpoint, family, tmp_path):
    """Each greedy token must be a maximum of the fp32 reference's logits up to bf16 error:
    exact token identity is too strict where two logits lie within bf16 rounding."""
    ckpt = checkpoint(family)
    engine = build_from_checkpoint(ckpt, tmp_path / "engine", max_model_len=256, dtype="bfloat16")
    prompt = random_prompts(1, seed=5)[0]
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.num_blocks": 256}) as llm:
        out = llm.generate_token_ids([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 32
    gap, scale = argmax_gaps(ckpt, prompt, out.token_ids)
    assert bool((gap <= BF16_REL_TOL * scale).all()), gap.tolist()
    exact = sum(int(g == 0) for g in gap.tolist())
    assert exact >= 24  # most steps pick the reference's own argmax


def test_cross_process_cuda_ipc_matches_single_process(checkpoint, tmp_path):
    """The spatial engine's prefill and decode workers are two processes that attach the
    weights and the KV pool through CUDA IPC; the decode worker continues sequences whose KV
    the prefill worker wrote. Without a partitioner (serve.partitioner=none) they need no MPS
    daemon, so this checks the sharing alone."""
    engine = build_from_checkpoint(checkpoint("llama"), tmp_path / "engine", max_model_len=256,
                                   dtype="float32")
    prompts = random_prompts(6, seed=21)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)] * 3
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.num_blocks": 256}) as llm:
        ref = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
    with LLM(str(engine), **{"serve.mode": "bullet", "serve.partitioner": "none", "kv.num_blocks": 256}) as llm:
        assert llm.engine.state.kv_pool.is_cuda
        out = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        workers = (llm.engine.prefill, llm.engine.decode)
        pids = {w.pid for w in workers}
        # CUDA IPC shares whole allocations, so the workers run fused q/k/v and gate/up GEMMs.
        assert [w.fused_groups for w in workers] == [2 * llm.engine.state.arch.num_layers] * 2
        stats = llm.engine.stats()
    assert len(pids) == 2 and os.getpid() not in pids
    assert out == ref
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe-mixed"])
def test_decode_cuda_graphs_match_eager(checkpoint, tmp_path, variant):
    """Decode steps replayed from CUDA graphs (Triton kernels, padded batch buckets; the MoE
    layers' routing and fused experts too) give the tokens of eager decode steps."""
    engine = build_from_checkpoint(checkpoint(variant), tmp_path / "engine", max_model_len=256,
                                   dtype="float32")
    prompts = random_prompts(5, seed=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.num_blocks": 256}) as llm:
        graphs = llm.engine.session.graphs
        assert graphs is not None
        graphed = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
        assert graphs.graphs, "no graph was captured"
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.num_blocks": 256,
                             "decode.cuda_graph_batch_sizes": []}) as llm:
        assert llm.engine.session.graphs is None
        eager = [c.token_ids for c in llm.generate_token_ids(prompts, params)]
    assert graphed == eager


def test_the_kv_pool_keeps_the_engine_within_its_memory_fraction(tmp_path):
    """The engine process (weights + pool) holds no more than kv.gpu_memory_fraction of the
    device: the space beyond it belongs to the workers' activations and graphs. Llama-3.1-8B
    shapes, whose fused-group layout frees ~9 GB of separately placed q/k/v and gate/up
    tensors before the pool is sized."""
    from bullet_trt.tools.build import build_dummy_engine
    from bullet_trt.config import load_engine_config
    from bullet_trt.engine.shared_state import build_shared_state
    engine = build_dummy_engine("llama-3.1-8b", tmp_path / "e", 4096, seed=0)
    fraction = 0.5
    cfg = load_engine_config(engine, {"kv.gpu_memory_fraction": fraction})
    free_before, total = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    state, model = build_shared_state(cfg, share=False)
    try:
        free, _ = torch.cuda.mem_get_info()
        held_by_this_test = free_before - free  # weights, pool, any cache kept beside them
        others = total - free_before
        idle = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        # Before the fix the idle cache was 7.2 GiB on an H200; what is left is rounding.
        assert idle < 2**30, f"{idle / 2**30:.2f} GiB of idle cache held beside the pool"
        assert others + held_by_this_test <= fraction * total + 2**30, (
            f"{(others + held_by_this_test) / 2**30:.1f} GiB in use, budget {fraction * total / 2**30:.1f} GiB")
    finally:
        del state, model
        torch.cuda.empty_cache()


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_moe-mixed"])
@pytest.mark.parametrize("activations", [False, True], ids=["fp8", "fp8-w8a8"])
def test_fp8_experts_match_transformers_on_their_dequantized_weights(checkpoint, variant, activations, tmp_path):
    """quantization=fp8 on a GPU: the Triton kernel over FP8 blocks, against transformers' fp32
    logits over the weights those blocks stand for (tests/test_fp8_experts.py checks the same on
    CPU), no farther from them than bf16 itself gets on those weights; with FP8 activations
    (fp8-w8a8) their rounding adds a few percent, 10% allowed."""
    from tests.test_fp8_experts import dequantized_copy

    ckpt = checkpoint(variant)
    prompts = random_prompts(8, seed=4)
    reference = dequantized_copy(ckpt, tmp_path / "dequantized")
    refs = torch.stack([hf_logits(reference, p)[-1] for p in prompts])
    # a routed model's bf16 error varies with the prompts: a router score near a tie picks
    # another expert in bf16 (these prompts: transformers in bf16 lands 4.7% from its fp32 logits)
    bf16_error = rel_err(our_last_logits(reference, prompts, block_size=16), refs)
    got = our_last_logits(ckpt, prompts, block_size=16, fp8_experts=True, fp8_activations=activations)
    assert rel_err(got, refs) < max(0.1 if activations else BF16_REL_TOL, 1.25 * bf16_error)


@pytest.mark.parametrize("mode", ["chunked", "bullet"])
def test_fp8_experts_serve_greedy_argmax_tokens(checkpoint, mode, tmp_path, request):
    """The engine with FP8 experts (their kernel variants compiled at warm-up, decode graphs
    captured over them; in bullet mode both workers attach the FP8 weights through CUDA IPC):
    each greedy token a maximum of the dequantized model's fp32 logits up to bf16 error."""
    from tests.test_fp8_experts import dequantized_copy

    ckpt = checkpoint("qwen3_moe")
    prompt, tokens, _ = served_greedy(ckpt, mode, tmp_path, request, seed=8, quantization="fp8")
    gap, scale = argmax_gaps(dequantized_copy(ckpt, tmp_path / "dequantized"), prompt, tokens)
    assert len(tokens) == 32 and bool((gap <= BF16_REL_TOL * scale).all()), gap.tolist()


def served_greedy(ckpt, mode: str, tmp_path, request, seed: int, **settings):
    """(prompt, 32 greedy tokens, the engine's stats after them) from a bf16 engine over ``ckpt``
    in ``mode`` (bullet: its workers on green partitions, under the MPS daemon) with ``settings``."""
    if mode == "bullet":
        request.getfixturevalue("mps_daemon")
        settings["serve.partitioner"] = "green"
    engine = build_from_checkpoint(ckpt, tmp_path / "engine", max_model_len=256, dtype="bfloat16")
    prompt = random_prompts(1, seed=seed)[0]
    with LLM(str(engine), **{"serve.mode": mode, "kv.num_blocks": 256, **settings}) as llm:
        out = llm.generate_token_ids([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
        return prompt, out.token_ids, llm.engine.stats()


@pytest.mark.parametrize("variant", ["qwen3", "llama-llama3", "qwen3_moe-mixed"])
def test_fp8_kv_cache_matches_transformers_rounding_its_kv(checkpoint, variant):
    """kv.cache_dtype=fp8 on a GPU (the Triton write rounding to E4M3, the attention kernels reading
    it): against transformers' fp32 logits with its attention's K/V rounded alike
    (tests/test_fp8_kv_cache.py, where on CPU the two agree exactly). Here the K/V are bf16 before
    they are rounded, and a value that bf16 moved across an E4M3 rounding midpoint lands a whole
    E4M3 step (1/8) from the reference's, so part of the rounding's own effect shows as error: the
    bound is bf16's own plus that effect (these prompts, on CPU: 1.8%, 8.5%, 3.5%; first GPU run:
    4.2% against llama's 8.5% effect). A pool read wrong (a block, a scale, a NaN) lands far beyond."""
    ckpt = checkpoint(variant)
    prompts = random_prompts(8, seed=6)
    rounded = torch.stack([hf_logits(ckpt, p, fp8_kv=True)[-1] for p in prompts])
    plain = torch.stack([hf_logits(ckpt, p)[-1] for p in prompts])
    bf16_error = rel_err(our_last_logits(ckpt, prompts, block_size=16), plain)
    got = our_last_logits(ckpt, prompts, block_size=16, kv_dtype=torch.float8_e4m3fn)
    effect = rel_err(rounded, plain)
    assert 1e-3 < effect < 0.1  # the rounding shows, and stays small
    assert rel_err(got, rounded) < max(BF16_REL_TOL, 1.25 * bf16_error) + effect


@pytest.mark.parametrize("mode", ["chunked", "bullet"])
def test_fp8_kv_cache_serves_greedy_argmax_tokens(checkpoint, mode, tmp_path, request):
    """The engine over an FP8 pool (decode graphs captured over it; in bullet mode both workers
    attach it through CUDA IPC, on green partitions): each greedy token a maximum of
    transformers' fp32 logits over E4M3-rounded K/V, up to bf16 error; every block back."""
    ckpt = checkpoint("qwen3")
    prompt, tokens, stats = served_greedy(ckpt, mode, tmp_path, request, seed=9, **{"kv.cache_dtype": "fp8"})
    gap, scale = argmax_gaps(ckpt, prompt, tokens, fp8_kv=True)
    assert len(tokens) == 32 and bool((gap <= BF16_REL_TOL * scale).all()), gap.tolist()
    assert stats.kv_blocks_free == stats.kv_blocks_total
