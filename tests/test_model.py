"""CausalLM against transformers on small random checkpoints, through the paged KV cache;
checkpoint parsing and loader errors."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bullet_trt.kernels import AttentionMetadata
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.loader import load_checkpoint, resolve_dtype
from bullet_trt.model.rope import build_cos_sin_cache
from bullet_trt.model.transformer import CausalLM

VARIANTS = ["llama-llama3", "llama-linear", "mistral", "qwen2", "qwen3", "qwen3-tied", "llama-sharded",
            "qwen3_moe", "qwen3_moe-mixed"]
TOL = 1e-4


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 2048, (n,), generator=g).tolist()


@functools.cache
def ours(path) -> CausalLM:
    arch = ModelArch.from_checkpoint(path)
    model = CausalLM(arch, torch.float32, "cpu")
    load_checkpoint(model, path, torch.float32)
    return model


@functools.cache
def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


def new_kv(model: CausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    a = model.arch
    return torch.zeros(a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim)


def table_for(n_tokens: int, block_size: int, first: int) -> list[int]:
    # Descending block ids, so a sequence's pages are neither contiguous nor in order.
    return list(range(first + (n_tokens - 1) // block_size, first - 1, -1))


def step(model: CausalLM, kv: torch.Tensor, seqs: list[tuple[list[int], int, list[int]]],
         block_size: int) -> list[torch.Tensor]:
    """One forward over packed (new_ids, num_cached, block_table) sequences: logits per sequence,
    one row per new token."""
    meta = AttentionMetadata.build([len(ids) for ids, _, _ in seqs], [c + len(ids) for ids, c, _ in seqs],
                                   [t for _, _, t in seqs], block_size, "cpu")
    input_ids = torch.tensor([i for ids, _, _ in seqs for i in ids])
    positions = torch.cat([torch.arange(c, c + len(ids)) for ids, c, _ in seqs])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, kv, meta))
    cu = meta.cu_seqlens_q.tolist()
    return [logits[cu[i]:cu[i + 1]] for i in range(len(seqs))]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_matches_transformers(checkpoint, variant):
    path = checkpoint(variant)
    model, ids = ours(path), prompt(21)
    ref = hf_logits(path, ids)
    assert ref.abs().max() > 1.0  # the random weights give logits far from uniform
    got = step(model, new_kv(model, 8, 16), [(ids, 0, table_for(21, 16, first=3))], 16)[0]
    assert max_diff(got, ref) <= TOL  # every position, not only the last


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_size_not_dividing_prompt(checkpoint, variant):
    path = checkpoint(variant)
    model, ids = ours(path), prompt(20, seed=1)
    got = step(model, new_kv(model, 8, 7), [(ids, 0, table_for(20, 7, first=1))], 7)[0]
    assert max_diff(got[-1], hf_logits(path, ids)[-1]) <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_uses_cached_kv(checkpoint, variant):
    path = checkpoint(variant)
    model, ids = ours(path), prompt(22, seed=2)
    kv, table = new_kv(model, 8, 16), table_for(22, 16, first=2)
    step(model, kv, [(ids[:13], 0, table[:1])], 16)
    got = step(model, kv, [(ids[13:], 13, table)], 16)[0]
    assert max_diff(got[-1], hf_logits(path, ids)[-1]) <= TOL


@pytest.mark.parametrize("variant", ["llama-llama3", "qwen2", "qwen3-tied", "qwen3_moe-mixed"])
def test_packed_batch_equals_each_alone(checkpoint, variant):
    model = ours(checkpoint(variant))
    prompts = [prompt(n, seed=10 + n) for n in (20, 5, 33, 1)]
    bs, tables, first = 16, [], 0
    for p in prompts:
        tables.append(table_for(len(p), bs, first))
        first += len(tables[-1])
    together = step(model, new_kv(model, first, bs), [(p, 0, t) for p, t in zip(prompts, tables)], bs)
    for p, t, got in zip(prompts, tables, together):
        alone = step(model, new_kv(model, first, bs), [(p, 0, t)], bs)[0]
        assert max_diff(got[-1], alone[-1]) <= TOL


def test_decode_steps_continue_a_prefill(checkpoint):
    """A prefill followed by one-token steps of two interleaved sequences."""
    path = checkpoint("qwen3")
    model, bs = ours(path), 4
    a, b = prompt(9, seed=3), prompt(6, seed=4)
    kv = new_kv(model, 16, bs)
    ta, tb = [0, 1, 2, 3], [7, 6, 5, 4]
    step(model, kv, [(a[:6], 0, ta), (b[:3], 0, tb)], bs)
    for k in range(3):
        la, lb = step(model, kv, [(a[6 + k:7 + k], 6 + k, ta), (b[3 + k:4 + k], 3 + k, tb)], bs)
    assert max_diff(la[-1], hf_logits(path, a)[-1]) <= TOL
    assert max_diff(lb[-1], hf_logits(path, b)[-1]) <= TOL


def test_bfloat16_checkpoint_runs_in_bfloat16(tmp_path):
    from tests.checkpoints import make_variant
    path = make_variant(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    arch = ModelArch.from_checkpoint(path)
    assert arch.torch_dtype == torch.bfloat16
    model = CausalLM(arch, torch.bfloat16, "cpu")
    load_checkpoint(model, path, torch.bfloat16)
    kv = new_kv(model, 2, 16).to(torch.bfloat16)
    ids = prompt(20, seed=6)
    got = step(model, kv, [(ids, 0, [1, 0])], 16)[0]
    # Loose: bfloat16 activations against transformers in float32 on the same (bf16) weights.
    assert got.dtype == torch.float32 and max_diff(got, hf_logits(path, ids)) < 0.25


def test_attach_weights_shares_storage(checkpoint):
    path = checkpoint("qwen3-tied")
    src = ours(path)
    state = {k: v for k, v in src.state_dict().items()}
    model = CausalLM(src.arch, torch.float32, "meta")
    model.attach_weights(state)
    assert model.model.embed_tokens.weight.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    ids = prompt(12, seed=5)
    got = step(model, new_kv(model, 2, 16), [(ids, 0, [1])], 16)[0]
    want = step(src, new_kv(src, 2, 16), [(ids, 0, [1])], 16)[0]
    assert torch.equal(got, want)

    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        CausalLM(src.arch, torch.float32, "meta").attach_weights(bad)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        CausalLM(src.arch, torch.float32, "meta").attach_weights(missing)


def _attached_fused_groups(queue, arch, state) -> None:
    model = CausalLM(arch, torch.float32, "meta")
    model.attach_weights(state)
    queue.put((model.fused_groups, model.model.layers[0].self_attn.q_proj.weight.data_ptr()
               == model.model.layers[0].self_attn.qkv[0].data_ptr()))


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])  # qwen2: q/k/v biases fuse too
def test_projection_groups_fuse_and_match_separate_gemms(checkpoint, variant):
    path = checkpoint(variant)
    fused = ours(path)
    layers = fused.arch.num_layers
    assert fused.fused_groups == 2 * layers
    attn = fused.model.layers[1].self_attn
    # The fused weight is the q/k/v parameters themselves, not a copy of them.
    assert attn.qkv[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert torch.equal(attn.qkv[0][-attn.v_proj.weight.shape[0]:], attn.v_proj.weight)
    assert (attn.qkv[1] is not None) == (variant == "qwen2")

    # Copies that do not lie back to back run one GEMM per projection, with the same result.
    separate = CausalLM(fused.arch, torch.float32, "meta")
    separate.attach_weights({k: v.clone() for k, v in fused.state_dict().items()})
    assert separate.fused_groups == 0
    ids = prompt(15, seed=8)
    got = step(fused, new_kv(fused, 2, 16), [(ids, 0, [0])], 16)[0]
    want = step(separate, new_kv(separate, 2, 16), [(ids, 0, [0])], 16)[0]
    assert max_diff(got, want) <= TOL


def test_weights_shared_with_another_process_stay_fused(checkpoint):
    """A worker process that attaches the weights through shared memory runs fused GEMMs
    over the same memory."""
    import torch.multiprocessing as mp
    src = ours(checkpoint("llama-llama3"))
    state = {k: v.share_memory_() for k, v in src.state_dict().items()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_attached_fused_groups, args=(queue, src.arch, state))
    proc.start()
    groups, same_memory = queue.get(timeout=120)
    proc.join(timeout=60)
    assert groups == 2 * src.arch.num_layers and same_memory


def test_parameter_names_are_huggingface_names(checkpoint):
    for variant, extra in (("qwen2", "self_attn.q_proj.bias"), ("qwen3", "self_attn.q_norm.weight"),
                           ("qwen3_moe", "mlp.experts.gate_up_proj")):
        path = checkpoint(variant)
        names = set(ours(path).state_dict())
        assert f"model.layers.1.{extra}" in names
        assert names == set(hf_model(path).state_dict())
    assert "lm_head.weight" not in ours(checkpoint("qwen3-tied")).state_dict()


# --- checkpoint parsing -------------------------------------------------------------------

def base_config(**kw) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             eos_token_id=[1, 2], torch_dtype="bfloat16")
    d.update(kw)
    return d


def test_arch_reads_both_rope_layouts():
    old = ModelArch.from_hf_dict(base_config(rope_theta=500000.0, rope_scaling={
        "type": "linear", "factor": 2.0}))
    new = ModelArch.from_hf_dict(base_config(rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}))
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.head_dim == 16 and old.eos_token_ids == [1, 2] and old.torch_dtype == torch.bfloat16
    assert ModelArch.from_hf_dict(base_config()).rope_scaling is None


def test_arch_family_specifics():
    qwen2 = ModelArch.from_hf_dict(base_config(architectures=["Qwen2ForCausalLM"], eos_token_id=5))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.eos_token_ids == [5]
    mistral = ModelArch.from_hf_dict(base_config(architectures=["MistralForCausalLM"], sliding_window=128))
    assert mistral.sliding_window == 128
    mistral.check_max_model_len(128)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        mistral.check_max_model_len(129)
    wide = ModelArch.from_hf_dict(base_config(architectures=["MistralForCausalLM"], sliding_window=4096))
    assert wide.sliding_window is None


def test_a_context_past_the_checkpoints_positions_is_refused_naming_both():
    arch = ModelArch.from_hf_dict(base_config(max_position_embeddings=512))
    arch.check_max_model_len(512)
    with pytest.raises(ValueError, match="max_model_len 513 exceeds the checkpoint's max_position_embeddings 512"):
        arch.check_max_model_len(513)


@pytest.mark.parametrize("step,dense", [(1, []), (2, []), (3, [2]), (1, [0, 4])])
def test_moe_layer_layout_follows_transformers(step, dense):
    """Which layers are sparse (decoder_sparse_step, mlp_only_layers), read off the modules
    transformers builds for the same config."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=step, mlp_only_layers=dense)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    want = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    arch = ModelArch.from_hf_dict(cfg.to_dict())
    assert arch.moe_layers == want and 0 < len(want)
    model = CausalLM(arch, torch.float32, "meta")
    assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")] == list(want)


def test_published_qwen3_moe_config_parses():
    """The preset is Qwen3-30B-A3B's config.json, which names the expert count num_experts
    (transformers 5 writes num_local_experts, read by the tests' checkpoints)."""
    from bullet_trt.model.presets import PRESETS
    arch = ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        "qwen3_moe", 128, 8, 768)
    assert arch.norm_topk_prob and arch.qk_norm and arch.moe_layers == tuple(range(48))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArch.from_hf_dict({**PRESETS["qwen3-30b-a3b"], "num_experts_per_tok": 129})


def test_moe_layers_fuse_attention_only(checkpoint):
    model = ours(checkpoint("qwen3_moe-mixed"))
    arch = model.arch
    assert model.fused_groups == 2 * arch.num_layers - len(arch.moe_layers)


def test_unknown_rope_type_is_refused():
    arch = ModelArch.from_hf_dict(base_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="yarn"):
        build_cos_sin_cache(arch, 16, "cpu")


def test_resolve_dtype():
    arch = ModelArch.from_hf_dict(base_config())
    assert resolve_dtype(arch, "auto", "cpu") == torch.float32
    assert resolve_dtype(arch, "auto", "cuda") == torch.bfloat16
    assert resolve_dtype(arch, "float16", "cpu") == torch.float16
    # a float32 checkpoint (the default model's, the tests' random ones) serves in half
    # precision on a GPU unless asked otherwise; a float16 one keeps its dtype
    fp32 = ModelArch.from_hf_dict(base_config(torch_dtype="float32"))
    fp16 = ModelArch.from_hf_dict(base_config(torch_dtype="float16"))
    assert fp32.torch_dtype == torch.float32 and resolve_dtype(fp32, "auto", "cuda") == torch.bfloat16
    assert resolve_dtype(fp32, "float32", "cuda") == torch.float32
    assert resolve_dtype(fp16, "auto", "cuda") == torch.float16
    assert resolve_dtype(fp32, "auto", "cpu") == torch.float32
    with pytest.raises(ValueError, match="fp8"):
        resolve_dtype(arch, "fp8", "cpu")


# --- loader errors ------------------------------------------------------------------------

def copy_of(checkpoint, variant, tmp_path):
    dst = tmp_path / variant
    shutil.copytree(checkpoint(variant), dst)
    return dst


def load(path):
    arch = ModelArch.from_checkpoint(path)
    load_checkpoint(CausalLM(arch, torch.float32, "cpu"), path, torch.float32)


def test_unknown_architecture_names_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base_config(architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match=r"config\.json.*architectures.*GPT2LMHeadModel"):
        ModelArch.from_checkpoint(tmp_path)


def test_missing_field_and_missing_config(tmp_path):
    cfg = base_config()
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*hidden_size"):
        ModelArch.from_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelArch.from_checkpoint(tmp_path / "nowhere")


def test_missing_shard(checkpoint, tmp_path):
    path = copy_of(checkpoint, "llama-sharded", tmp_path)
    (path / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00004.safetensors"):
        load(path)


def test_no_weights_file(checkpoint, tmp_path):
    path = copy_of(checkpoint, "mistral", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(path)


def test_missing_tensor(checkpoint, tmp_path):
    path = copy_of(checkpoint, "mistral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(path)


def test_shape_mismatch(checkpoint, tmp_path):
    path = copy_of(checkpoint, "mistral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.down_proj\.weight"):
        load(path)


def test_tied_checkpoint_with_stray_lm_head_loads(checkpoint, tmp_path):
    path = copy_of(checkpoint, "qwen3-tied", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors")
    load(path)


def test_stacked_expert_checkpoint_loads_as_per_expert_one(checkpoint, tmp_path):
    """A checkpoint holding the stacked expert tensors under the model's own names loads to
    the same parameters as the per-expert one transformers saves."""
    path = copy_of(checkpoint, "qwen3_moe", tmp_path)
    want = ours(checkpoint("qwen3_moe")).state_dict()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in load_file(path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in want.items()}, path / "model.safetensors")
    model = CausalLM(ModelArch.from_checkpoint(path), torch.float32, "cpu")
    load_checkpoint(model, path, torch.float32)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_missing_expert_tensor_is_named(checkpoint, tmp_path):
    path = copy_of(checkpoint, "qwen3_moe", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        load(path)
