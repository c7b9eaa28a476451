"""Small random Hugging Face checkpoints for tests, made with transformers itself."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bullet_trt.model.corpus_tokenizer import write_corpus_tokenizer

VOCAB_SIZE = 2048  # the corpus tokenizer's
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

# Named test checkpoints: each stresses one feature of the model or the loader.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama"),
    # original_max_position_embeddings 32 puts head_dim 16's frequencies in all three llama3
    # bands (kept, smoothed, divided), so every branch of the formula is exercised.
    "llama-llama3": dict(family="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "llama-linear": dict(family="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": dict(family="mistral"),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
    "qwen3-tied": dict(family="qwen3", tie_word_embeddings=True),
    "llama-sharded": dict(family="llama", sharded=True),
    # one KV head for four q heads: under tensor parallelism every rank keeps that head
    "llama-1kv": dict(family="llama", config=dict(num_key_value_heads=1)),
    # a vocabulary that two ranks split unevenly, tied to the lm_head; biases on q/k/v, o_proj
    # and the MLP (Llama's attention_bias and mlp_bias), added once after a row-parallel sum
    "llama-odd-vocab": dict(family="llama", tie_word_embeddings=True,
                            config=dict(vocab_size=2001, attention_bias=True, mlp_bias=True)),
    # Llama 3's vocabulary: a step's logits are megabytes a row, as the allocator sees them served
    "llama-large-vocab": dict(family="llama", config=dict(vocab_size=128256)),
    # 16 experts, top 4, renormalised (as Qwen3-30B-A3B); every layer sparse
    "qwen3_moe": dict(family="qwen3_moe", moe=dict(norm_topk_prob=True)),
    # raw top-k probabilities, and both ways a Qwen3-MoE config keeps dense MLPs:
    # decoder_sparse_step 2 makes layers 1, 3, 5 sparse, mlp_only_layers takes 3 back
    "qwen3_moe-mixed": dict(family="qwen3_moe", moe=dict(
        norm_topk_prob=False, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])),
}

MOE_DEFAULTS = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)


def _config(family: str, tie_word_embeddings: bool, rope_scaling: dict | None, moe: dict | None,
            config: dict | None = None):
    import transformers

    common = {**dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=1),
        **(config or {})}
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    rope.setdefault("rope_theta", 10000.0)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if family == "mistral":
        # A window longer than the position limit never masks anything: plain causal attention.
        return transformers.MistralConfig(**common, rope_parameters=rope, sliding_window=4096)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters=rope)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, rope_parameters=rope)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**common, **MOE_DEFAULTS, **(moe or {})}, rope_parameters=rope)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp: with transformers' std 0.02 init every
    attention pattern is nearly uniform and a RoPE or masking bug would not show in logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * noise  # away from 1, so a skipped norm weight shows
        elif name.endswith(".bias"):
            value = 0.1 * noise
        elif "embed_tokens" in name:
            value = noise
        else:
            # sharp attention; a decisive router, so wrong routing shows in the logits
            gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight", "mlp.gate.weight")) else 1.0
            value = gain * noise / math.sqrt(p.shape[-1])  # fan-in, stacked experts too
        p.copy_(value.to(p.dtype))


def make_checkpoint(out_dir: str | Path, family: str, dtype: torch.dtype = torch.float32,
                    sharded: bool = False, tie_word_embeddings: bool = False,
                    rope_scaling: dict | None = None, moe: dict | None = None, seed: int = 0,
                    config: dict | None = None) -> Path:
    """Writes config.json, safetensors weights and the corpus tokenizer into out_dir.
    config: fields of the transformers config that differ from the small defaults."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" noise
    out = Path(out_dir)
    config = _config(family, tie_word_embeddings, rope_scaling, moe, config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.to(dtype)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB" if sharded else "2GB")
    write_corpus_tokenizer(out)
    return out


def make_variant(out_dir: str | Path, name: str, **overrides: Any) -> Path:
    kwargs = {**VARIANTS[name], **overrides}
    return make_checkpoint(out_dir, kwargs.pop("family"), **kwargs)
