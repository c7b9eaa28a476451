"""Tensor parallelism on CPU: two ranks, each a process of its own joined over torch.distributed
(gloo), give the tokens one process gives, through the chunked engine and through Bullet's
workers (two per rank); every rank's KV pool gives back each block it lent."""
from __future__ import annotations

import os

import pytest

from bullet_trt.config import ConfigError
from bullet_trt.engine.block_journal import BlockReplica, JournaledAllocator
from bullet_trt.engine.request import NewRequest
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.tensor_parallel import Collectives, Shard
from bullet_trt.serving.llm import LLM
from bullet_trt.serving.memory_plan import kv_heads_per_rank
from tests.test_engine import engine_dir_for, prompts

TP2 = {"parallel.tensor_parallel_size": 2}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)

# KV heads split (2 of them over 2 ranks) and replicated (1 for both ranks); experts split by
# range; a vocabulary that does not split evenly (the last rank's rows padded), tied to the
# lm_head, with the row-parallel projections' biases added once after the all-reduce
VARIANTS = ["llama", "llama-1kv", "qwen3_moe", "llama-odd-vocab"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            made[variant] = engine_dir_for(tmp_path_factory, variant)[0]
        return made[variant]
    return get


def generate(engine, batch, params, **overrides):
    with LLM(str(engine), **overrides) as llm:
        out = [c.token_ids for c in llm.generate_token_ids(batch, params)]
        return out, llm.engine.stats(), llm.engine


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_give_the_tokens_of_one(engines, variant):
    engine = engines(variant)
    batch = prompts(5, seed=3)
    params = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY]
    ref, _, _ = generate(engine, batch, params)
    out, stats, core = generate(engine, batch, params, **TP2)
    assert out == ref
    total = stats.kv_blocks_total
    assert stats.kv_blocks_free_by_rank == (total, total)
    follower = core.ranks.procs[0]
    assert follower.pid != os.getpid() and follower.exitcode == 0  # stopped with the engine


def test_collectives_go_into_graphs_only_where_there_are_some():
    """parallel.decode_graphs asks for decode graphs with the collectives captured inside; one
    rank has none to capture."""
    assert Collectives(Shard(0, 2), in_graphs=True).in_graphs
    assert not Collectives(Shard(), in_graphs=True).in_graphs
    assert not Collectives(Shard(0, 2)).in_graphs


def test_decode_graphs_leave_cpu_ranks_eager_and_exact(engines):
    """gloo's collectives (a CPU's) cannot be captured: with the setting on, both ranks still
    decode eager and give one process's tokens. tests/gpu/test_tensor_parallel_gpu.py runs the
    graphs themselves over NCCL."""
    engine = engines("llama")
    batch = prompts(3, seed=5)
    params = [GREEDY, SEEDED, GREEDY]
    ref, _, _ = generate(engine, batch, params)
    with LLM(str(engine), **TP2, **{"parallel.decode_graphs": True}) as llm:
        leader = llm.engine.session
        assert not leader.model.tp.in_graphs and leader.session.graphs is None
        out = [c.token_ids for c in llm.generate_token_ids(batch, params)]
    assert out == ref


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_bullet_with_two_ranks_gives_the_tokens_of_one(engines, variant):
    """Each rank has its own prefill and decode worker; rank 0's workers hand the others the
    batches, decode updates and splits they take, so all four run the steps the one
    orchestrator decided."""
    from bullet_trt.serving.triton.process_tree import descendants

    engine = engines(variant)
    batch = prompts(6, seed=21)
    params = [GREEDY, SEEDED] * 3
    ref, _, _ = generate(engine, batch, params)
    with LLM(str(engine), **{**TP2, "serve.mode": "bullet"}) as llm:
        out = [c.token_ids for c in llm.generate_token_ids(batch, params)]
        stats = llm.engine.stats()
        follower = llm.engine.ranks.procs[0]
        follower_workers = [pid for pid, parent, _ in descendants(follower.pid) if parent == follower.pid]
        own_workers = {llm.engine.prefill.pid, llm.engine.decode.pid}
    assert out == ref
    assert len(follower_workers) == 2 and not own_workers & set(follower_workers)
    total = stats.kv_blocks_total
    assert stats.kv_blocks_free_by_rank == (total, total)


def test_abort_frees_the_blocks_of_every_rank(engines):
    with LLM(str(engines("llama")), **TP2) as llm:
        core = llm.engine
        for i, ids in enumerate(prompts(3)):
            core.add_request(NewRequest(f"r{i}", ids, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
        core.step()
        core.step()
        total = core.stats().kv_blocks_total
        held = core.stats().kv_blocks_free_by_rank
        assert held[0] == held[1] < total  # rank 1 counts the blocks rank 0 lent
        core.abort_request("r1")
        finished = {o.request_id: o.finish_reason for o in core.step() if o.finished}
        assert finished == {"r1": "abort"}
        while core.has_unfinished():
            core.step()
        assert core.stats().kv_blocks_free_by_rank == (total, total)


def test_sizes_that_do_not_split_the_model_are_refused_before_any_rank_starts(engines):
    engine = engines("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        LLM(str(engine), **{"parallel.tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        LLM(str(engine), **{"parallel.tensor_parallel_size": 0})


def test_shards_hold_the_kv_heads_their_q_heads_read():
    arch = ModelArch.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 1001, "hidden_size": 64,
                                   "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
                                   "num_key_value_heads": 2, "max_position_embeddings": 64})
    group = arch.num_heads // arch.num_kv_heads  # q heads per KV head
    for size in (1, 2, 4, 8):
        shards = [Shard(r, size) for r in range(size)]
        for s in shards:
            s.check(arch)
            first, count = s.q_heads(arch)
            kv_first, kv_count = s.kv_heads(arch)
            assert {h // group for h in range(first, first + count)} <= set(range(kv_first, kv_first + kv_count))
            assert kv_count == kv_heads_per_rank(arch, size)  # what the memory plan sizes
        # the vocabulary's ranges cover it once, in order
        ranges = [s.vocab(arch) for s in shards]
        assert [f for f, _ in ranges] == [sum(n for _, n in ranges[:i]) for i in range(size)]
        assert sum(n for _, n in ranges) == arch.vocab_size
    with pytest.raises(ValueError, match="KV heads"):
        Shard(0, 3).check(ModelArch.from_hf_dict({**{"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                     "hidden_size": 48, "intermediate_size": 96,
                                                     "num_hidden_layers": 1, "max_position_embeddings": 8},
                                                  "num_attention_heads": 6, "num_key_value_heads": 2}))


def test_a_replica_follows_the_journal_and_refuses_what_it_does_not_hold():
    leader, replica = JournaledAllocator(8), BlockReplica(8)
    a, b = leader.allocate(3), leader.allocate(2)
    leader.free(a)
    replica.replay(leader.take_journal())
    assert replica.num_free == leader.num_free == 6 and leader.take_journal() == []
    greedy = SamplingParams(temperature=0)
    replica.check([BatchItem("b", [1], 0, b, greedy, True)])
    with pytest.raises(RuntimeError, match="holds as free"):
        replica.check([BatchItem("a", [1], 0, a, greedy, True)])
    with pytest.raises(RuntimeError, match="holds as taken"):
        replica.replay([(True, b)])
    with pytest.raises(RuntimeError, match="holds as free"):
        replica.replay([(False, a)])


def test_the_tp_flag_sets_the_tensor_parallel_size(engines, capsys):
    """`--tp N` of generate, serve and bench serve is --set parallel.tensor_parallel_size=N."""
    from bullet_trt.tools.bench.serve_bench import build_parser, server_settings
    from bullet_trt.tools.cli import main

    engine = str(engines("llama"))
    generate = ["generate", "--engine-dir", engine, "--prompt", "Hello there", "--max-tokens", "8", "--ignore-eos"]
    assert main(generate) == 0
    one = capsys.readouterr().out
    assert main(generate + ["--tp", "2"]) == 0
    assert capsys.readouterr().out == one and one.strip()
    assert main(["serve", "--engine-dir", engine, "--dry-run", "--no-openai", "--tp", "2"]) == 0
    assert '"parallel.tensor_parallel_size": "2"' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not divide"):
        main(["serve", "--engine-dir", engine, "--dry-run", "--no-openai", "--tp", "3"])
    sets = server_settings(build_parser().parse_args(["--tp", "2", "--set", "serve.chunk_size=64"]))
    assert sets["parallel.tensor_parallel_size"] == "2" and sets["serve.chunk_size"] == "64"


def test_dummy_weights_of_a_rank_are_its_slice_of_the_one_rank_model():
    """Each rank draws every tensor whole from the seed and keeps its slice, so a dummy-weight
    engine is one model at any number of ranks (tests/gpu compares their tokens on the
    Llama-3.1-8B shape)."""
    import torch

    from bullet_trt.model.transformer import CausalLM

    arch = ModelArch.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 101, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64,
                                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                   "mlp_only_layers": [0]})
    whole = CausalLM(arch, torch.float32, "cpu")
    whole.init_random_weights(5)
    full = dict(whole.named_parameters())
    for rank in range(2):
        shard = Shard(rank, 2)
        part = CausalLM(arch, torch.float32, "cpu", shard=shard)
        part.init_random_weights(5)
        for name, p in part.named_parameters():
            piece = shard.checkpoint_slice(name, arch)
            want = full[name] if piece is None else full[name].narrow(piece.dim, piece.start, piece.stop - piece.start)
            got = p if piece is None else p.narrow(piece.dim, 0, piece.stop - piece.start)
            assert torch.equal(got, want), name
            if piece is not None and got.shape != p.shape:
                assert not p.narrow(piece.dim, got.shape[piece.dim], p.shape[piece.dim] - got.shape[piece.dim]).any()


def test_device_sizing_sizes_a_rank_from_its_share():
    """Llama-3.1-70B on 139.8 GiB GPUs: one cannot hold it; each of two ranks holds half the
    weights and its KV heads' pool (the rows docs/large-runs.md plans), and its decode step
    reads half the bytes, so more rows fit the TPOT budget."""
    from bullet_trt.config import EngineConfig
    from bullet_trt.model.presets import PRESETS
    from bullet_trt.serving.device_sizing import GpuFacts, size_for
    from bullet_trt.spatial.perf_model import ModelCost

    arch = ModelArch.from_hf_dict(PRESETS["llama-3.1-70b"])
    notes, rows = {}, {}
    for tp in (1, 2):
        cfg = EngineConfig(dtype="bfloat16")
        cfg.parallel.tensor_parallel_size = tp
        notes[tp] = size_for(cfg, arch, GpuFacts("NVIDIA H200", int(139.8 * 2**30), 132))[0]
        rows[tp] = cfg.decode.max_num_seqs
    assert "memory 0," in notes[1] and "memory 679," in notes[2]
    assert rows[2] > rows[1]
    cost = ModelCost.from_arch(arch, 2)
    half = cost.per_rank(2, kv_heads_per_rank(arch, 2), arch.num_kv_heads)
    assert half.weight_bytes == cost.weight_bytes / 2 and half.kv_bytes_per_token == cost.kv_bytes_per_token / 2
    assert cost.per_rank(1, arch.num_kv_heads, arch.num_kv_heads) is cost
