"""FP8 experts (quantization=fp8): the block format against a plain loop over the blocks, the
model against transformers holding the block-dequantized experts, and the engines (chunked,
bullet's worker processes, two tensor-parallel ranks) against one process with those weights.
The Triton kernel's FP8 path is tests/gpu/test_fused_moe.py's (the Triton interpreter on CPU)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bullet_trt.config import ConfigError, EngineConfig, load_engine_config
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.kernels import fp8_blocks
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.expert_weights import is_expert_tensor
from bullet_trt.model.loader import load_checkpoint
from bullet_trt.model.transformer import CausalLM
from bullet_trt.serving.llm import LLM
from bullet_trt.tools.bench.iteration_records import load
from bullet_trt.tools.build import build_from_checkpoint
from tests.test_engine import engine_dir_for, prompts
from tests.test_model import hf_logits, max_diff, new_kv, prompt, step, table_for

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
FP8 = {"quantization": "fp8"}


def blockwise_by_loop(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format written out block by block: scale = amax / 448, q = w / scale in E4M3."""
    rows, cols = w.shape
    rb, cb = -(-rows // 128), -(-cols // 128)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rb, cb)
    for i in range(rb):
        for j in range(cb):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            s = block.abs().max() / 448.0
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 32)])
def test_blocks_match_a_loop_over_them(shape):
    w = torch.randn(*shape) * torch.linspace(0.1, 3.0, shape[1])  # columns of different sizes
    q, scale = fp8_blocks.quantize(w)
    want_q, want_scale = blockwise_by_loop(w)
    assert scale.shape == want_scale.shape == fp8_blocks.scale_shape(*shape)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = fp8_blocks.dequantize(q, scale, torch.float32)
    # E4M3 keeps 3 mantissa bits (half an ulp: 1/16 of a value, at most), and below 2^-6 steps
    # of 2^-9: in units of the block's scale
    per_weight = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    assert ((back - w).abs() <= w.abs() / 16 + per_weight * 2.0 ** -10 * 1.001).all()
    assert ((back - w).norm() / w.norm()).item() < 0.04
    # the largest weight of each block lands on E4M3's largest value
    assert q.float().abs().max().item() == 448.0


def test_gate_and_up_quantize_apart():
    """A stacked gate-and-up tensor keeps each half's blocks, whatever inter is (here 100: the
    gate's last block and the up's first would share rows if the stack were cut in 128s)."""
    inter, hidden = 100, 96
    gate, up = torch.randn(3, inter, hidden), 50 * torch.randn(3, inter, hidden)
    q, scale = fp8_blocks.quantize_gate_up(torch.cat([gate, up], dim=1))
    assert scale.shape == (3, 2, 1)
    for e in range(3):
        assert torch.equal(scale[e, :1], blockwise_by_loop(gate[e])[1])
        assert torch.equal(scale[e, 1:], blockwise_by_loop(up[e])[1])
    back = fp8_blocks.dequantize_gate_up(q, scale, torch.float32)
    assert ((back[:, :inter] - gate).norm() / gate.norm()).item() < 0.04
    assert ((back[:, inter:] - up).norm() / up.norm()).item() < 0.04


def fp8_model(path) -> CausalLM:
    model = CausalLM(ModelArch.from_checkpoint(path), torch.float32, "cpu", fp8_experts=True)
    load_checkpoint(model, path, torch.float32)
    return model


def dequantized_copy(path, dst, quantized=None):
    """The checkpoint at ``path`` with each tensor ``quantized`` names (default: the experts')
    replaced by its FP8 blocks read back: the model an FP8 server computes, for transformers
    and the bf16 path to run."""
    shutil.copytree(path, dst)
    arch = ModelArch.from_checkpoint(path)
    quantized = quantized or (lambda name: is_expert_tensor(name, arch.moe_layers, arch.num_experts))
    tensors = load_file(dst / "model.safetensors")
    for name, w in tensors.items():
        if quantized(name):
            tensors[name] = fp8_blocks.dequantize(*fp8_blocks.quantize(w), w.dtype)
    save_file(tensors, dst / "model.safetensors")
    return dst


def linear_weight(name: str) -> bool:
    """What a fine-grained FP8 checkpoint quantizes: the linear layers but the router and the
    vocabulary's."""
    return (name.endswith("proj.weight") or ".experts." in name) and not name.endswith("mlp.gate.weight")


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_checkpoint(path, dst):
    """The checkpoint at ``path`` written as a fine-grained FP8 one: each linear weight as E4M3
    blocks with its ``weight_scale_inv``, and the quantization_config that says so."""
    shutil.copytree(path, dst)
    tensors = {}
    for name, w in load_file(dst / "model.safetensors").items():
        if linear_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks.quantize(w)
        else:
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return dst


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_moe-mixed"])
def test_fp8_experts_match_transformers_on_the_dequantized_experts(checkpoint, variant, tmp_path):
    path = checkpoint(variant)
    model, ids = fp8_model(path), prompt(21, seed=4)
    got = step(model, new_kv(model, 8, 16), [(ids, 0, table_for(21, 16, first=3))], 16)[0]
    want = hf_logits(dequantized_copy(path, tmp_path / "dequantized"), ids)
    assert max_diff(got, want) <= 1e-4
    # and the quantization is not a no-op: the bf16 experts' logits differ by far more
    assert max_diff(want, hf_logits(path, ids)) > 1e-2


def test_stacked_checkpoint_quantizes_as_the_per_expert_one(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    want = fp8_model(path).state_dict()
    stacked = CausalLM(ModelArch.from_checkpoint(path), torch.float32, "cpu")
    load_checkpoint(stacked, path, torch.float32)
    dst = tmp_path / "stacked"
    shutil.copytree(path, dst)
    save_file({k: v.contiguous() for k, v in stacked.state_dict().items()}, dst / "model.safetensors")
    got = fp8_model(dst).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k], want[k]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fp8_blocks.FP8 \
            else torch.equal(a, b), k


def test_dummy_fp8_experts_are_the_dummy_experts_quantized(checkpoint):
    arch = ModelArch.from_checkpoint(checkpoint("qwen3_moe"))
    plain, fp8 = CausalLM(arch, torch.float32, "cpu"), CausalLM(arch, torch.float32, "cpu", fp8_experts=True)
    plain.init_random_weights(5)
    fp8.init_random_weights(5)
    for layer_plain, layer_fp8 in zip(plain.model.layers, fp8.model.layers):
        e, f = layer_plain.mlp.experts, layer_fp8.mlp.experts
        q, s = fp8_blocks.quantize_gate_up(e.gate_up_proj)
        assert torch.equal(q.view(torch.uint8), f.gate_up_proj.view(torch.uint8)) and torch.equal(s, f.gate_up_scale)
        q, s = fp8_blocks.quantize(e.down_proj)
        assert torch.equal(q.view(torch.uint8), f.down_proj.view(torch.uint8)) and torch.equal(s, f.down_scale)
        assert torch.equal(layer_plain.self_attn.q_proj.weight, layer_fp8.self_attn.q_proj.weight)  # as it was


@pytest.fixture(scope="module")
def moe_engines(tmp_path_factory):
    """(engine over the checkpoint, engine over its block-dequantized copy)."""
    engine, ckpt = engine_dir_for(tmp_path_factory, "qwen3_moe")
    root = tmp_path_factory.mktemp("dequantized")
    copy = dequantized_copy(ckpt, root / "ckpt")
    return engine, build_from_checkpoint(copy, root / "engine", max_model_len=256, dtype="float32")


def tokens(engine, **overrides):
    batch = prompts(4, seed=9)
    with LLM(str(engine), **overrides) as llm:
        out = [c.token_ids for c in llm.generate_token_ids(batch, [GREEDY, SEEDED, GREEDY, SEEDED])]
        stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    return out


@pytest.mark.parametrize("overrides", [
    {"serve.mode": "chunked"},
    {"serve.mode": "bullet"},  # the workers attach the FP8 weights the engine process loaded
    {"serve.mode": "chunked", "parallel.tensor_parallel_size": 2},  # each rank quantizes its experts
], ids=["chunked", "bullet", "tp2"])
def test_engines_serve_the_dequantized_model(moe_engines, overrides):
    fp8_engine, dequantized_engine = moe_engines
    assert tokens(fp8_engine, **FP8, **overrides) == tokens(dequantized_engine, **{"serve.mode": "chunked"})


def test_quantization_errors_name_the_field(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, fp8, fp8-w8a8, got .int4."):
        EngineConfig(quantization="int4").validate()
    dense = tmp_path / "dense"
    shutil.copytree(checkpoint("llama"), dense)
    engine = build_from_checkpoint(dense, tmp_path / "engine", max_model_len=256, dtype="float32")
    with pytest.raises(ValueError, match="quantization=fp8.*no MoE layers"):
        LLM(str(engine), **FP8)


@pytest.mark.parametrize("quantization", ["fp8", "none"])
def test_an_fp8_checkpoint_computes_its_dequantized_model(checkpoint, tmp_path, quantization):
    """A fine-grained FP8 checkpoint (every linear layer quantized): FP8 experts keep its blocks
    as they are (fp8), or every weight is dequantized (none); either computes what
    transformers computes on the dequantized weights."""
    path = checkpoint("qwen3_moe-mixed")
    stored = fp8_checkpoint(path, tmp_path / "fp8")
    arch = ModelArch.from_checkpoint(stored)
    assert arch.fp8_checkpoint and arch.fp8_experts(quantization) == (quantization == "fp8")
    model = CausalLM(arch, torch.float32, "cpu", fp8_experts=arch.fp8_experts(quantization))
    load_checkpoint(model, stored, torch.float32)
    ids = prompt(19, seed=6)
    got = step(model, new_kv(model, 8, 16), [(ids, 0, table_for(19, 16, first=1))], 16)[0]
    want = hf_logits(dequantized_copy(path, tmp_path / "dequantized", linear_weight), ids)
    assert max_diff(got, want) <= 1e-4
    if quantization == "fp8":  # the checkpoint's own blocks, not quantized again
        layer = arch.moe_layers[0]
        blocks = load_file(stored / "model.safetensors")[f"model.layers.{layer}.mlp.experts.3.down_proj.weight"]
        kept = model.model.layers[layer].mlp.experts.down_proj[3]
        assert torch.equal(kept.view(torch.uint8), blocks.view(torch.uint8))


@pytest.mark.parametrize("overrides", [{"serve.mode": "bullet"},
                                       {"serve.mode": "chunked", "parallel.tensor_parallel_size": 2}],
                         ids=["bullet", "tp2"])  # tp2: each rank dequantizes its slices of attention
def test_an_fp8_checkpoint_serves_through_the_engine(checkpoint, tmp_path, overrides):
    path = checkpoint("qwen3_moe")
    fp8_engine = build_from_checkpoint(fp8_checkpoint(path, tmp_path / "fp8"), tmp_path / "e1", max_model_len=256,
                                       dtype="float32")
    reference = build_from_checkpoint(dequantized_copy(path, tmp_path / "deq", linear_weight), tmp_path / "e2",
                                      max_model_len=256, dtype="float32")
    assert tokens(fp8_engine, **FP8, **overrides) == tokens(reference, **{"serve.mode": "chunked"})


@pytest.mark.parametrize("scheme, experts", [("dynamic", "fp8-w8a8"), ("static", "fp8"), (None, "fp8")])
def test_auto_serves_an_fp8_checkpoint_as_its_activation_scheme_says(checkpoint, tmp_path, scheme, experts):
    """The published FP8 checkpoints name dynamic activations (rounded to FP8 per token and 128
    columns as they run): auto runs their experts so (fp8-w8a8); a static scheme's per-tensor
    activation scales are not read, its experts take FP8 weights only; a dense or bf16
    checkpoint is untouched."""
    stored = fp8_checkpoint(checkpoint("qwen3_moe"), tmp_path / "fp8")
    config = json.loads((stored / "config.json").read_text())
    quant = {key: value for key, value in config["quantization_config"].items() if key != "activation_scheme"}
    config["quantization_config"] = quant | ({"activation_scheme": scheme} if scheme else {})
    (stored / "config.json").write_text(json.dumps(config))
    assert ModelArch.from_checkpoint(stored).expert_quantization("auto") == experts
    assert ModelArch.from_checkpoint(checkpoint("qwen3_moe")).expert_quantization("auto") == "none"
    if scheme == "dynamic":  # served end to end, as `auto` leaves it
        engine = build_from_checkpoint(stored, tmp_path / "e", max_model_len=256, dtype="float32")
        assert tokens(engine) == tokens(engine, **{"quantization": "fp8-w8a8"})


@pytest.mark.parametrize("quant, field", [({**FP8_CONFIG, "quant_method": "awq"}, "quant_method"),
                                          ({**FP8_CONFIG, "weight_block_size": [64, 64]}, "weight_block_size"),
                                          ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt")])
def test_other_quantized_checkpoints_are_refused_naming_the_field(checkpoint, tmp_path, quant, field):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3_moe"), dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(NotImplementedError, match=f"quantization_config.{field}"):
        ModelArch.from_checkpoint(dst)


def naive_w8a8_moe(x, layer, weights, ids):
    """One MoE layer with FP8 experts and FP8 activations, token by token: each product's input
    rounded per 128 columns, as a plain loop over the assignments."""
    def rounded(v):
        return fp8_blocks.dequantize_token_groups(*fp8_blocks.quantize_token_groups(v[None]), v.dtype)[0]

    e = layer.mlp.experts
    gate_up = fp8_blocks.dequantize_gate_up(e.gate_up_proj, e.gate_up_scale, torch.float32)
    down = fp8_blocks.dequantize(e.down_proj, e.down_scale, torch.float32)
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            g = int(ids[t, slot])
            h = gate_up[g] @ rounded(x[t])
            out[t] += weights[t, slot] * (down[g] @ rounded(torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def test_fp8_activations_round_each_products_input(checkpoint):
    """quantization=fp8-w8a8: the layer against a plain loop with the same rounding, and the
    model's logits near the FP8-weights-only model's (the activations' rounding, a few percent)."""
    path = checkpoint("qwen3_moe")
    arch = ModelArch.from_checkpoint(path)
    assert arch.expert_quantization("fp8-w8a8") == "fp8-w8a8" and arch.fp8_experts("fp8-w8a8")
    w8a8 = CausalLM(arch, torch.float32, "cpu", fp8_experts=True, fp8_activations=True)
    load_checkpoint(w8a8, path, torch.float32)
    layer = w8a8.model.layers[arch.moe_layers[0]]
    x = torch.randn(5, arch.hidden_size)
    weights, ids = w8a8.ops.moe_route(layer.mlp.gate(x), layer.mlp.top_k, layer.mlp.renormalize)
    got = layer.mlp(w8a8.ops, x)
    assert max_diff(got, naive_w8a8_moe(x, layer, weights, ids)) <= 1e-5
    ids_ = prompt(21, seed=4)
    logits = step(w8a8, new_kv(w8a8, 8, 16), [(ids_, 0, table_for(21, 16, first=3))], 16)[0]
    w8 = fp8_model(path)
    weights_only = step(w8, new_kv(w8, 8, 16), [(ids_, 0, table_for(21, 16, first=3))], 16)[0]
    rel = ((logits - weights_only).norm() / weights_only.norm()).item()
    assert 1e-4 < rel < 0.1, rel


def test_fp8_activations_serve_the_same_tokens_in_every_engine(moe_engines):
    engine, _ = moe_engines
    settings = {"quantization": "fp8-w8a8"}
    chunked = tokens(engine, **settings, **{"serve.mode": "chunked"})
    assert tokens(engine, **settings, **{"serve.mode": "bullet"}) == chunked
    assert tokens(engine, **settings, **{"serve.mode": "chunked", "parallel.tensor_parallel_size": 2}) == chunked
    arch = ModelArch.from_checkpoint(load_engine_config(str(engine)).checkpoint_path)
    with pytest.raises(ValueError, match="FP8 activations go with FP8 experts"):
        CausalLM(arch, torch.float32, "meta", fp8_activations=True)


@pytest.mark.parametrize("slices", [False, True], ids=["whole", "slices"])
def test_prompts_fused_into_w8a8_moe_decode_steps_over_an_fp8_pool_give_chunkeds_tokens(moe_engines, tmp_path,
                                                                                       slices):
    """The configuration the MoE's fused steps are served in on a GPU (FP8 experts and
    activations, an FP8 KV pool, the decode worker's own pieces): prompts that ride in decode's
    steps, whole or in slices, get the tokens chunked serving gives them, and every block comes
    back."""
    engine, _ = moe_engines
    settings = {"quantization": "fp8-w8a8", "kv.cache_dtype": "fp8"}
    log = tmp_path / "fused.jsonl"
    fused = tokens(engine, **settings, **{
        "serve.mode": "bullet", "serve.fuse_prefill": "always", "serve.prefill_hold_fraction": 0,
        "prefill.max_num_seqs": 1, "decode.piecewise_graph_tokens": "[16, 64, 128]",
        "serve.fuse_prompt_slices": slices, "serve.chunk_size": 48 if slices else 512,
        "serve.iteration_log": str(log)})
    assert fused == tokens(engine, **settings, **{"serve.mode": "chunked"})
    steps = [r for r in load(log) if r["phase"] == "fused"]
    assert steps and all(r["prompts"] >= 1 for r in steps)
    if slices:
        # a slice filled a step's budget beside the rows its admission counted (the worker's
        # batch may have gained or lost rows by the time the step ran)
        assert max(r["planned_rows"] + r["tokens"] - (r["batch"] - r["prompts"]) for r in steps) == 48
