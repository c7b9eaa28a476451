"""Device sizing (serve.sizing=auto): the decode slots, their graphs and the chunk a server
picks for a GPU from its memory and the performance model, with what the user set kept.
The GPU's facts are parameters here; the served path reads them from the device."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bullet_trt.config import EngineConfig, apply_overrides
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.serving.device_sizing import GRAPH_BUCKETS, MAX_DECODE_ROWS, GpuFacts, decode_rows, size_for
from bullet_trt.serving.modes import resolve_mode

GiB = 2**30
H200_CALIBRATION = Path(__file__).resolve().parents[1] / "docs/data/perf_model_h200_llama-3.1-8b.yaml"
H200 = GpuFacts("NVIDIA H200", 141 * GiB, 132)  # the GPU the calibration above was measured on
H100 = GpuFacts("NVIDIA H100 80GB HBM3", 80 * GiB, 132)  # not calibrated: sized from defaults


def config(tmp_path, overrides=None, calibrated=True) -> EngineConfig:
    if calibrated:
        shutil.copy(H200_CALIBRATION, tmp_path / "perf_model.yaml")
    cfg = EngineConfig(engine_dir=str(tmp_path))
    cfg.prefill.max_model_len = cfg.decode.max_model_len = 4096
    return apply_overrides(cfg, overrides)


@pytest.fixture
def llama8b() -> ModelArch:
    return ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"])


def test_an_8b_model_gets_the_slots_its_kv_fits_on_an_h100_and_the_largest_measured_on_an_h200(tmp_path, llama8b):
    h100, why100 = decode_rows(config(tmp_path), llama8b, H100, 2)
    h200, why200 = decode_rows(config(tmp_path), llama8b, H200, 2)
    # KV of one 512-token row of Llama-3.1-8B: 64 MiB; 80 GiB * 0.85 less 16 GB of weights
    # holds ~850 such rows, 141 GiB ~1680
    assert why100.startswith("memory") and h100 == 768
    assert h200 == MAX_DECODE_ROWS and "memory 16" in why200
    assert h100 in GRAPH_BUCKETS and h200 in GRAPH_BUCKETS


def test_the_tpot_slo_bounds_the_slots_when_memory_does_not(tmp_path, llama8b):
    roomy, _ = decode_rows(config(tmp_path), llama8b, H200, 2)
    tight, why = decode_rows(config(tmp_path, {"serve.tpot_slo_ms": 15}), llama8b, H200, 2)
    assert why.startswith("TPOT") and tight < roomy


def test_sizing_sets_what_no_override_names_and_keeps_the_rest(tmp_path, llama8b):
    cfg = config(tmp_path)
    notes = size_for(cfg, llama8b, H200)
    assert cfg.decode.max_num_seqs == cfg.decode.max_num_batched_tokens == 1024
    assert cfg.decode.cuda_graph_batch_sizes == list(GRAPH_BUCKETS)
    assert cfg.serve.chunk_size == 2048 and len(notes) == 4
    assert cfg.prefill.piecewise_graph_tokens == []  # bullet's prefill worker runs eagerly
    assert cfg.decode.overlap_steps  # bullet's decode worker launches its steps one ahead

    kept = config(tmp_path, {"decode.max_num_seqs": "256", "serve.chunk_size": "1024"})
    size_for(kept, llama8b, H200)
    assert kept.decode.max_num_seqs == 256 and kept.serve.chunk_size == 1024
    assert kept.decode.cuda_graph_batch_sizes[-1] == 256  # graphs follow the slots given


def test_chunked_mode_gets_its_own_chunk_and_piecewise_graphs_up_to_it(tmp_path, llama8b):
    cfg = config(tmp_path, {"serve.mode": "chunked"})
    notes = size_for(cfg, llama8b, H200)
    assert cfg.serve.chunk_size == 1024
    assert cfg.prefill.piecewise_graph_tokens == [128, 256, 512, 768, 1024]
    assert any(n.startswith("prefill.piecewise_graph_tokens") for n in notes)

    given = config(tmp_path, {"serve.mode": "chunked", "serve.chunk_size": "2048",
                              "prefill.piecewise_graph_tokens": "[]"})
    size_for(given, llama8b, H200)
    assert given.serve.chunk_size == 2048 and given.prefill.piecewise_graph_tokens == []
    graphs_follow = config(tmp_path, {"serve.mode": "chunked", "serve.chunk_size": "2048"})
    size_for(graphs_follow, llama8b, H200)
    assert graphs_follow.prefill.piecewise_graph_tokens[-1] == 2048


def test_an_moe_models_spatial_prefill_worker_gets_piecewise_graphs_and_a_dense_ones_does_not(tmp_path, llama8b):
    moe = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    bullet = config(tmp_path, {"serve.mode": "bullet"})
    notes = size_for(bullet, moe, H200)
    assert bullet.prefill.piecewise_graph_tokens == [128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]  # as measured served
    assert any(n.startswith("prefill.piecewise_graph_tokens") for n in notes)
    small_chunk = config(tmp_path, {"serve.mode": "bullet", "serve.chunk_size": "768"})
    size_for(small_chunk, moe, H200)
    assert small_chunk.prefill.piecewise_graph_tokens == [128, 256, 512, 768]
    dense = config(tmp_path, {"serve.mode": "bullet"})
    size_for(dense, llama8b, H200)
    assert dense.prefill.piecewise_graph_tokens == []
    ranks = config(tmp_path, {"serve.mode": "bullet", "parallel.tensor_parallel_size": "2"})
    size_for(ranks, moe, H200)
    assert ranks.prefill.piecewise_graph_tokens == []  # pieces run on one rank only


def test_an_moe_models_spatial_prefill_batches_may_hold_32_prompts_unless_told_otherwise(tmp_path, llama8b):
    moe = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    for mode in ("bullet", "static"):
        sized = config(tmp_path, {"serve.mode": mode})
        assert "prefill.max_num_seqs=32" in size_for(sized, moe, H200) and sized.prefill.max_num_seqs == 32
    told = config(tmp_path, {"serve.mode": "bullet", "prefill.max_num_seqs": "12"})
    size_for(told, moe, H200)
    assert told.prefill.max_num_seqs == 12
    larger = config(tmp_path, {"serve.mode": "bullet"})
    larger.prefill.max_num_seqs = 64  # engine.yaml's own, larger cap is not cut down
    size_for(larger, moe, H200)
    assert larger.prefill.max_num_seqs == 64
    for mode, arch, tp in (("chunked", moe, "1"), ("bullet", llama8b, "1"), ("bullet", moe, "2")):
        kept = config(tmp_path, {"serve.mode": mode, "parallel.tensor_parallel_size": tp})
        notes = size_for(kept, arch, H200)
        assert kept.prefill.max_num_seqs == 8 and not any(n.startswith("prefill.max_num_seqs") for n in notes)


def test_chunked_and_bullet_launch_their_steps_one_ahead_on_one_gpu_unless_told_otherwise(tmp_path, llama8b):
    moe = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    for mode in ("chunked", "bullet"):
        for arch in (llama8b, moe):
            sized = config(tmp_path, {"serve.mode": mode})
            assert "decode.overlap_steps=true" in size_for(sized, arch, H200) and sized.decode.overlap_steps
    told = config(tmp_path, {"serve.mode": "chunked", "decode.overlap_steps": "false"})
    size_for(told, llama8b, H200)
    assert not told.decode.overlap_steps
    ranks = config(tmp_path, {"serve.mode": "bullet", "parallel.tensor_parallel_size": "2"})
    size_for(ranks, llama8b, H200)
    assert not ranks.decode.overlap_steps  # the overlapped loops run on one GPU
    static = config(tmp_path, {"serve.mode": "static"})
    size_for(static, llama8b, H200)
    assert not static.decode.overlap_steps  # unmeasured there


def test_bullet_plans_an_moe_models_decode_steps_up_to_the_tpot_slo_unless_told_otherwise(tmp_path, llama8b):
    moe = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    bullet = config(tmp_path, {"serve.mode": "bullet"})
    notes = size_for(bullet, moe, H200)
    assert bullet.serve.tpot_plan_fraction == 1.0 and "serve.tpot_plan_fraction=1.0" in notes
    told = config(tmp_path, {"serve.mode": "bullet", "serve.tpot_plan_fraction": "0.9"})
    size_for(told, moe, H200)
    assert told.serve.tpot_plan_fraction == 0.9
    for other_mode, arch in (("chunked", moe), ("bullet", llama8b)):
        kept = config(tmp_path, {"serve.mode": other_mode})
        notes = size_for(kept, arch, H200)
        assert kept.serve.tpot_plan_fraction == 0.85
        assert not any(n.startswith("serve.tpot_plan_fraction") for n in notes)


def test_a_looser_decode_plan_is_sized_before_the_slots_it_bounds(tmp_path):
    moe = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    tight = {"serve.mode": "bullet", "serve.tpot_slo_ms": "20"}
    planned = config(tmp_path, tight)
    size_for(planned, moe, H200)
    default_plan = config(tmp_path, {**tight, "serve.tpot_plan_fraction": "0.85"})
    size_for(default_plan, moe, H200)
    assert planned.decode.max_num_seqs > default_plan.decode.max_num_seqs


def test_overrides_are_recorded_and_never_saved(tmp_path):
    from bullet_trt.config import load_engine_config, save_engine_config

    save_engine_config(EngineConfig(checkpoint="ckpt"), tmp_path)
    cfg = load_engine_config(tmp_path, {"serve.mode": "chunked", "decode.max_num_seqs": "8"})
    assert cfg.overridden == ["serve.mode", "decode.max_num_seqs"]
    save_engine_config(cfg, tmp_path)
    assert load_engine_config(tmp_path).overridden == []
    assert "overridden" not in (tmp_path / "engine.yaml").read_text()


def test_an_override_of_the_wrong_kind_is_refused_by_its_key():
    from bullet_trt.config import ConfigError
    cfg = apply_overrides(EngineConfig(checkpoint="ckpt"), {"serve.row_tpot_budget": "on"})
    assert cfg.serve.row_tpot_budget is True
    assert apply_overrides(cfg, {"serve.row_tpot_budget": "false"}).serve.row_tpot_budget is False
    with pytest.raises(ConfigError, match="serve.row_tpot_budget: expected true or false, got 'maybe'"):
        apply_overrides(EngineConfig(checkpoint="ckpt"), {"serve.row_tpot_budget": "maybe"})
    with pytest.raises(ConfigError, match="serve.tpot_plan_fraction: could not convert"):
        apply_overrides(EngineConfig(checkpoint="ckpt"), {"serve.tpot_plan_fraction": "high"})


def test_auto_mode_is_chunked_without_a_gpu(tmp_path):
    assert resolve_mode(config(tmp_path, {"device": "cpu"})) == "chunked"
    assert resolve_mode(config(tmp_path, {"serve.mode": "bullet"})) == "bullet"


def test_auto_mode_serves_chunked_under_a_tpot_slo_too_tight_for_the_split(tmp_path, monkeypatch, capsys):
    from bullet_trt.spatial.partitioners import mps_daemon

    monkeypatch.setattr(mps_daemon, "mps_daemon_running", lambda: True)  # a GPU whose workers could share it
    assert resolve_mode(config(tmp_path, {"device": "cuda", "serve.tpot_slo_ms": "50"})) == "bullet"
    assert resolve_mode(config(tmp_path, {"device": "cuda", "serve.tpot_slo_ms": "40"})) == "bullet"
    assert resolve_mode(config(tmp_path, {"device": "cuda", "serve.tpot_slo_ms": "25"})) == "chunked"
    assert "serve.tpot_slo_ms=25 is under 40 ms" in capsys.readouterr().err
    assert resolve_mode(config(tmp_path, {"device": "cuda", "serve.tpot_slo_ms": "25",
                                          "serve.mode": "bullet"})) == "bullet"


def test_serve_starts_a_private_mps_daemon_only_where_asked_or_a_gpu_needs_one(tmp_path):
    import torch

    from bullet_trt.serving.mode_choice import may_run_spatial
    from bullet_trt.tools.cli import _private_mps_wanted

    spatial = config(tmp_path)
    assert _private_mps_wanted("on", spatial) is True and _private_mps_wanted("off", spatial) is False
    # a configuration that can only serve chunked needs no daemon; asked for, it gets one
    chunked = config(tmp_path, {"serve.mode": "chunked"})
    tight = config(tmp_path, {"serve.tpot_slo_ms": "25"})
    assert not may_run_spatial(chunked) and not may_run_spatial(tight)
    assert _private_mps_wanted("auto", chunked) is False and _private_mps_wanted("auto", tight) is False
    assert _private_mps_wanted("on", tight) is True
    assert may_run_spatial(config(tmp_path)) and may_run_spatial(config(tmp_path, {"serve.mode": "static"}))
    assert may_run_spatial(config(tmp_path, {"serve.mode": "bullet", "serve.tpot_slo_ms": "25"}))
    if not torch.cuda.is_available():
        assert _private_mps_wanted("auto", spatial) is False


@pytest.mark.parametrize("name, published", [("llama-3.1-8b", 8.0), ("llama-3.1-70b", 70.6),
                                             ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1)])
def test_the_memory_plan_counts_the_published_parameters(name, published):
    from bullet_trt.serving.memory_plan import parameters

    assert parameters(ModelArch.from_hf_dict(PRESETS[name])) / 1e9 == pytest.approx(published, abs=0.1)


def test_the_memory_plan_shards_weights_and_kv_heads_across_ranks():
    from bullet_trt.serving.memory_plan import plan_rank

    llama70 = ModelArch.from_hf_dict(PRESETS["llama-3.1-70b"])
    one, two, eight = (plan_rank(llama70, 2, tp, 141 * GiB, 0.85) for tp in (1, 2, 8))
    assert not one.fits and two.fits  # 141 GB of bf16 weights need two H200s
    assert two.weight_bytes == pytest.approx(one.weight_bytes / 2)
    assert eight.kv_bytes_per_token == one.kv_bytes_per_token / 8  # 8 KV heads, one per rank
    qwen235 = ModelArch.from_hf_dict(PRESETS["qwen3-235b-a22b"])
    four, eight = (plan_rank(qwen235, 2, tp, 141 * GiB, 0.85) for tp in (4, 8))
    # 4 KV heads over 8 ranks: each keeps one, so the KV per token stops shrinking at TP=4
    assert four.kv_bytes_per_token == eight.kv_bytes_per_token
    assert eight.weight_bytes > four.weight_bytes / 2  # the replicated K/V projections
    with pytest.raises(ValueError, match="must divide the 64 attention heads"):
        plan_rank(qwen235, 2, 3, 141 * GiB, 0.85)


def test_fp8_experts_hold_the_experts_at_a_byte_a_weight():
    """Qwen3-30B-A3B: 29.0B of its 30.5B weights are experts; FP8 halves those alone."""
    from bullet_trt.serving.memory_plan import expert_parameters, parameters, plan_rank

    arch = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    assert expert_parameters(arch) / 1e9 == pytest.approx(29.0, abs=0.05)
    bf16, fp8 = (plan_rank(arch, 2, 1, 141 * GiB, 0.85, fp8_experts=f) for f in (False, True))
    assert bf16.weight_bytes == pytest.approx(2 * parameters(arch))
    assert bf16.weight_bytes - fp8.weight_bytes == pytest.approx(expert_parameters(arch) * (1 - 4 / 128 ** 2))
    assert fp8.rows > bf16.rows
    dense = ModelArch.from_hf_dict(PRESETS["llama-3.1-8b"])
    assert plan_rank(dense, 2, 1, 141 * GiB, 0.85, fp8_experts=True) == plan_rank(dense, 2, 1, 141 * GiB, 0.85)
