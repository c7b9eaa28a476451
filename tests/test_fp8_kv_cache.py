"""kv.cache_dtype=fp8: K and V cached as E4M3 at a scale of 1.

The model over an FP8 pool is checked against transformers whose attention rounds its keys and
values to E4M3 the same way (registered below as an attention implementation: the keys it sees
are after RoPE and Qwen3's k-norm, which is what the pool stores), so the comparison is as tight
as the bf16 pool's; and against plain transformers, to show the rounding is not a no-op. The
engines (chunked in one process, bullet's workers attaching the pool from the engine process)
must generate what transformers does. The Triton kernels' FP8 path is
tests/gpu/test_triton_kernels.py's.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from bullet_trt.config import ConfigError, EngineConfig, KVCacheConfig
from bullet_trt.engine.kv_pool import bytes_per_block, fill_random
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.kernels import reference
from bullet_trt.kernels.fp8_kv import standard_layout
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.serving.llm import LLM
from bullet_trt.serving.memory_plan import plan_rank
from tests.test_engine import engine_dir_for, prompts
from tests.test_model import hf_logits, max_diff, ours, prompt, step, table_for

FP8 = torch.float8_e4m3fn
TOL = 1e-4  # the bf16-pool checks' own (tests/test_model.py)
ROUNDED = "fp8_kv_rounded"


def rounded_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(FP8).to(x.dtype)


def attention_over_rounded_kv(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, rounded_to_e4m3(key), rounded_to_e4m3(value), attention_mask,
                 scaling=scaling, dropout=dropout, **kwargs)


@functools.cache
def hf_rounded(path):
    """transformers' model at ``path`` (fp32) whose attention reads E4M3-rounded K/V."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(ROUNDED, attention_over_rounded_kv)
    AttentionMaskInterface.register(ROUNDED, eager_mask)  # the causal mask eager attention takes
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ROUNDED).eval()


def fp8_kv(model, num_blocks: int, block_size: int) -> torch.Tensor:
    a = model.arch
    return torch.zeros(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=FP8)


@pytest.mark.parametrize("variant", ["qwen3", "llama-llama3", "qwen3_moe-mixed"])
def test_model_over_an_fp8_pool_matches_transformers_rounding_kv(checkpoint, variant):
    path = checkpoint(variant)
    model, ids = ours(path), prompt(22, seed=5)
    kv, table = fp8_kv(model, 8, 16), table_for(22, 16, first=2)
    first = step(model, kv, [(ids[:13], 0, table[:1])], 16)[0]  # then the rest over the cached 13
    rest = step(model, kv, [(ids[13:], 13, table)], 16)[0]
    with torch.no_grad():
        want = hf_rounded(path)(torch.tensor([ids])).logits[0].float()
    assert max_diff(torch.cat([first, rest]), want) <= TOL
    # the pool's rounding shows: plain transformers differs by far more
    assert max_diff(want, hf_logits(path, ids)) > 100 * TOL


def test_reference_write_rounds_and_saturates():
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=FP8)
    k = torch.randn(3, 2, 8) * torch.tensor([1.0, 1000.0, 0.01]).view(3, 1, 1)
    v = -k
    slots = torch.tensor([0, 5, 14])
    reference.write_kv_cache(k, v, cache, slots)
    standard = standard_layout(cache).float().view(2, 16, 2, 8)
    stored = standard[:, slots]
    assert torch.equal(stored[0], rounded_to_e4m3(k)) and torch.equal(stored[1], rounded_to_e4m3(v))
    assert stored[0, 1].abs().max().item() == 448.0 and not stored.isnan().any()
    assert torch.equal(standard[:, 1], torch.zeros(2, 2, 8))  # other slots untouched
    # V slots-innermost: slot 5 (block 1, slot 1), head 1, dim 3 at block * 64 + (head * 8 + dim) * 4 + slot
    assert cache[1].float().flatten()[1 * 64 + (1 * 8 + 3) * 4 + 1] == rounded_to_e4m3(v)[1, 1, 3]
    assert cache[0].float().flatten()[5 * 16 + 1 * 8 + 3] == rounded_to_e4m3(k)[1, 1, 3]  # K as it was


def test_fill_random_draws_an_fp8_pool():
    pool = torch.zeros(2, 2, 3, 4, 2, 8, dtype=FP8)
    fill_random(pool)
    values = pool.float()
    assert not values.isnan().any() and 0.5 < values.std().item() < 1.5 and (values != 0).float().mean() > 0.9


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    return engine_dir_for(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("mode,tp", [("chunked", 1), ("bullet", 1), ("chunked", 2)],
                         ids=["chunked", "bullet", "tp2"])  # bullet: worker processes attach the FP8 pool
def test_engines_over_an_fp8_pool_generate_what_transformers_does(qwen3_engine, mode, tp):
    engine, ckpt = qwen3_engine
    batch = prompts(3, seed=12)
    with torch.no_grad():
        want = [hf_rounded(ckpt).generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24,
                                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
                for ids in batch]
    with LLM(str(engine), **{"kv.cache_dtype": "fp8", "serve.mode": mode, "kv.block_size": 8,
                             "parallel.tensor_parallel_size": tp}) as llm:
        got = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
        stats = llm.engine.stats()
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.block_size": 8, "parallel.tensor_parallel_size": tp}) as llm:
        plain_blocks = llm.engine.stats().kv_blocks_total
    assert got == want
    assert stats.kv_blocks_free == stats.kv_blocks_total  # every block back
    # the same kv.cpu_pool_mib holds a byte a value against the float32 engine's four
    assert stats.kv_blocks_total == torch.float32.itemsize * plain_blocks


def test_kv_cache_dtype_errors_name_the_field():
    with pytest.raises(ConfigError, match="kv.cache_dtype must be one of auto, fp8, got 'int8'"):
        EngineConfig(kv=KVCacheConfig(cache_dtype="int8")).validate()


def test_memory_plan_holds_twice_the_tokens_in_fp8():
    arch = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"], source="qwen3-30b-a3b")
    plain = plan_rank(arch, 2, 1, 140 * 2**30, 0.85, fp8_experts=True)
    fp8 = plan_rank(arch, 2, 1, 140 * 2**30, 0.85, fp8_experts=True, kv_dtype_bytes=1)
    assert fp8.pool_bytes == plain.pool_bytes and fp8.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    assert fp8.rows in (2 * plain.rows, 2 * plain.rows + 1)
    assert bytes_per_block(arch, 16, FP8) * 2 == bytes_per_block(arch, 16, torch.bfloat16)
