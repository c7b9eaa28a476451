"""Engine core: generation against transformers, batching invariance, sampling rules,
paged-pool accounting and the prefill/decode split across processes."""
from __future__ import annotations

import pytest
import torch

from bullet_trt.engine.block_allocator import BlockAllocator, OutOfBlocks
from bullet_trt.serving.llm import LLM
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.tools.build import build_from_checkpoint
from tests.checkpoints import make_variant

# the dense families, and Qwen3-MoE with renormalised top-k on every layer and with raw top-k
# beside dense layers
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe-mixed"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def engine_dir_for(tmp_path_factory, variant: str, **kw):
    root = tmp_path_factory.mktemp(f"{variant}-engine")
    ckpt = make_variant(root / "ckpt", variant, **kw)
    return build_from_checkpoint(ckpt, root / "engine", max_model_len=256, dtype="float32"), ckpt


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    return engine_dir_for(tmp_path_factory, "llama")[0]


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("variant", FAMILIES)
def test_greedy_matches_transformers_generate(tmp_path_factory, variant):
    from transformers import AutoModelForCausalLM
    engine, ckpt = engine_dir_for(tmp_path_factory, variant)
    ids = prompts(1, seed=7)[0]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    with LLM(str(engine), **{"kv.block_size": 7}) as llm:
        out = llm.generate_token_ids([ids], GREEDY)[0]
    assert out.token_ids == ref


def test_request_alone_equals_inside_mixed_batch(llama_engine):
    batch = prompts(8)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    params = [GREEDY if i % 2 else seeded for i in range(8)]
    with LLM(str(llama_engine)) as llm:
        together = llm.generate_token_ids(batch, params)
        for i in (0, 3, 6):
            alone = llm.generate_token_ids([batch[i]], params[i])[0]
            assert alone.token_ids == together[i].token_ids


def test_chunked_prefill_and_small_blocks_give_same_tokens(llama_engine):
    batch = prompts(4, seed=3)
    with LLM(str(llama_engine)) as llm:
        ref = [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)]
    # a 16-token budget forces prompts through several chunks next to running decodes
    with LLM(str(llama_engine), **{"serve.mode": "chunked", "serve.chunk_size": 16,
                                   "kv.block_size": 5}) as llm:
        assert [c.token_ids for c in llm.generate_token_ids(batch, GREEDY)] == ref


def test_seed_reproducible_and_sampling_rules(llama_engine):
    ids = prompts(1, seed=9)[0]
    with LLM(str(llama_engine)) as llm:
        gen = lambda p: llm.generate_token_ids([ids], p)[0]
        a = gen(SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True))
        b = gen(SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True))
        c = gen(SamplingParams(max_tokens=20, temperature=1.0, seed=43, ignore_eos=True))
        assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
        greedy = gen(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert gen(SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=5, ignore_eos=True)).token_ids == greedy.token_ids
        assert gen(SamplingParams(max_tokens=20, temperature=0.7, top_p=1e-6, seed=5, ignore_eos=True)).token_ids == greedy.token_ids
        # end id: stop where greedy would emit token t; min_tokens bans it before that
        t = greedy.token_ids[5]
        first = greedy.token_ids.index(t)
        stopped = gen(SamplingParams(max_tokens=20, temperature=0, end_id=t))
        assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:first]
        late = gen(SamplingParams(max_tokens=20, temperature=0, end_id=t, min_tokens=first + 3))
        assert len(late.token_ids) >= first + 3 and t not in late.token_ids[:first + 3]
        # stop sequence of two tokens ends the request after them
        seq = greedy.token_ids[3:5]
        cut = gen(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[seq]))
        assert cut.finish_reason == "stop" and cut.token_ids[-2:] == seq and len(cut.token_ids) <= 5
        assert gen(SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)).finish_reason == "length"
        # log-probs are those of the sampled tokens under the model's distribution
        lp = gen(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True))
        assert len(lp.logprobs) == 4 and all(x <= 0 for x in lp.logprobs)
        assert lp.logprobs[0] == pytest.approx(max_logprob_of_next(llm, ids), abs=1e-4)


def max_logprob_of_next(llm: LLM, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llm.cfg.checkpoint_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    return float(torch.log_softmax(logits, -1).max())


def test_pool_exhaustion_preempts_and_returns_every_block(llama_engine):
    # 24 blocks of 16 tokens cannot hold 12 requests of ~100 tokens at once
    with LLM(str(llama_engine), **{"kv.num_blocks": 24}) as llm:
        batch = prompts(12, seed=11)
        with LLM(str(llama_engine)) as roomy:
            ref = [c.token_ids for c in roomy.generate_token_ids(batch, GREEDY)]
        out = llm.generate_token_ids(batch, GREEDY)
        stats = llm.engine.stats()
        assert [c.token_ids for c in out] == ref
        assert stats.num_preemptions > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total == 24


def test_abort_frees_blocks(llama_engine):
    with LLM(str(llama_engine)) as llm:
        core = llm.engine
        for i, ids in enumerate(prompts(3)):
            core.add_request(NewRequest(f"r{i}", ids, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
        core.step(); core.step()
        assert core.stats().kv_blocks_free < core.stats().kv_blocks_total
        core.abort_request("r1")
        finished = {o.request_id: o.finish_reason for o in core.step() if o.finished}
        assert finished == {"r1": "abort"}
        while core.has_unfinished():
            core.step()
        assert core.stats().kv_blocks_free == core.stats().kv_blocks_total


def test_bad_requests_name_the_limit(llama_engine, tmp_path):
    with LLM(str(llama_engine)) as llm:
        core = llm.engine
        with pytest.raises(ValueError, match="limit is 255"):
            core.add_request(NewRequest("long", [5] * 300, SamplingParams()))
        with pytest.raises(ValueError, match="empty"):
            core.add_request(NewRequest("empty", [], SamplingParams()))
        with pytest.raises(ValueError, match="top_p"):
            core.add_request(NewRequest("p", [5], SamplingParams(top_p=1.5)))
    with pytest.raises(ValueError, match="KV pool too small"):
        LLM(str(llama_engine), **{"kv.num_blocks": 3})
    with pytest.raises(ValueError, match="prefill.max_num_seqs"):
        LLM(str(llama_engine), **{"prefill.max_num_seqs": 0})


def test_allocator_refuses_double_free():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(blocks[:1])


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    return engine_dir_for(tmp_path_factory, "qwen3_moe-mixed")[0]


@pytest.mark.parametrize("engine_fixture", ["llama_engine", "moe_engine"])
def test_prefill_and_decode_in_two_processes_match_one_process(request, engine_fixture):
    """Bullet's split: the prefill and decode workers attach one copy of the weights (the MoE
    layers' stacked experts too) and continue each other's sequences."""
    engine = request.getfixturevalue(engine_fixture)
    batch = prompts(6, seed=21)
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)] * 3
    with LLM(str(engine)) as llm:
        ref = [c.token_ids for c in llm.generate_token_ids(batch, params)]
    with LLM(str(engine), **{"serve.mode": "bullet"}) as llm:
        out = llm.generate_token_ids(batch, params)
        workers = (llm.engine.prefill, llm.engine.decode)
        pids = {w.pid for w in workers}
        fused = [w.fused_groups for w in workers]
        arch = llm.engine.state.arch
        stats = llm.engine.stats()
    import os
    assert len(pids) == 2 and os.getpid() not in pids
    # shared memory kept the fused layout (an MoE layer's MLP is its stacked experts)
    assert fused == [2 * arch.num_layers - len(arch.moe_layers)] * 2
    assert [c.token_ids for c in out] == ref
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_sequence_token_slices_match_the_concatenated_list():
    from bullet_trt.engine.sequence import Sequence
    seq = Sequence("s", [5, 6, 7, 8], SamplingParams(), output_token_ids=[9, 10, 11])
    whole = seq.all_token_ids
    for start in range(len(whole) + 1):
        for count in range(len(whole) - start + 1):
            assert seq.token_ids(start, count) == whole[start:start + count]


def test_banned_tokens_are_masked_per_row_in_one_batch():
    from bullet_trt.engine.sampling import SamplingBatch, sample
    logits = torch.zeros(6, 10)
    logits[:, 4] = 5.0  # everyone's argmax
    logits[:, 7] = 4.0
    logits[:, 2] = 3.0
    params = [SamplingParams(temperature=0.0)] * 6
    # rows sharing a list of banned ids are masked together, in any order of the ids
    batch = SamplingBatch.build(params, [0] * 6, [[4], [], [4, 7], [4], [7, 4], [4, 7, 2]], "cpu")
    tokens, _ = sample(logits.clone(), batch)  # float32 logits are masked in place
    assert tokens.tolist() == [7, 4, 2, 7, 2, 0]
    # every row banning the same ids (a fixed-length benchmark's end tokens): one mask for all
    batch = SamplingBatch.build(params, [0] * 6, [[4, 7]] * 6, "cpu")
    assert sample(logits.clone(), batch)[0].tolist() == [2] * 6


def test_a_greedy_batch_picks_in_bfloat16_what_float32_picks():
    """Greedy rows without log-probabilities take the argmax of the logits as they are: bfloat16
    widens to float32 exactly, so ties and bans come out as in float32."""
    from bullet_trt.engine.sampling import SamplingBatch, sample
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(8, 300, generator=g) * 4).to(torch.bfloat16)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the first index wins in both
    banned = [[], [int(logits[1].float().argmax())], [10], [], [7, 8], [], [], [int(logits[7].float().argmax())]]
    params = [SamplingParams(temperature=0.0)] * 8

    def picks(values, scratch=None):
        batch = SamplingBatch.build(params, [0] * 8, banned, "cpu")
        tokens, logprobs = sample(values, batch, scratch)
        assert logprobs is None
        return tokens.tolist()

    scratch = torch.full((8, 300), float("nan"))
    assert picks(logits.clone(), scratch) == picks(logits.float())
    assert torch.isnan(scratch).all()  # no float32 copy was made
    assert picks(logits.clone())[2] == 20  # its tie's first index banned, the second wins


def test_sampling_in_a_scratch_buffer_picks_what_a_fresh_copy_does():
    """A GPU session samples its bf16 logits in one float32 buffer made at start
    (`float32_scratch`); tokens and log-probabilities are those of a fresh float32 copy, for
    greedy, seeded and banned rows, and a batch larger than the buffer still samples."""
    from bullet_trt.engine.sampling import SamplingBatch, float32_scratch, sample
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 50, generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.2, top_k=7, seed=9, logprobs=True),
              SamplingParams(temperature=0.7, top_p=0.5, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=2)]
    banned = [[], [3], [], [int(logits[3].float().argmax())], [], []]

    def picks(scratch):
        batch = SamplingBatch.build(params, list(range(6)), banned, "cpu")
        tokens, logprobs = sample(logits.clone(), batch, scratch)
        return tokens.tolist(), logprobs.tolist()

    fresh = picks(None)
    scratch = torch.full((8, 50), float("nan"))
    assert picks(scratch) == fresh
    assert torch.isfinite(scratch[:6]).any() and torch.isnan(scratch[6:]).all()  # it was used, its rows only
    assert picks(torch.empty(4, 50)) == fresh  # too few rows: a fresh copy
    assert float32_scratch(4, 50, torch.device("cpu")) is None


def test_outputs_of_one_request_coalesce_in_order():
    from bullet_trt.engine.request import RequestOutput, coalesce
    outs = [RequestOutput("a", [1], [-0.1]), RequestOutput("b", [7]), RequestOutput("a", [2, 3], [-0.2, -0.3]),
            RequestOutput("a", [], None, True, "length", 4, 3)]
    a, b = coalesce(outs)
    assert (a.request_id, a.new_token_ids, a.new_logprobs) == ("a", [1, 2, 3], [-0.1, -0.2, -0.3])
    assert a.finished and a.finish_reason == "length" and a.num_output_tokens == 3
    assert (b.request_id, b.new_token_ids, b.finished) == ("b", [7], False)
