"""The tiny random model (engines/tiny-random): a Llama-architecture checkpoint with RANDOM,
UNTRAINED weights (deterministic from a seed), small enough that a server test answers in
milliseconds per token on two CPU cores. Its text is gibberish; the tokenizer beside it
(bullet_trt.model.corpus_tokenizer) is a real byte-level BPE. The default model is a trained
one (bullet_trt.tools.default_model).
"""
from __future__ import annotations

import json
from pathlib import Path

# Big enough to exercise GQA, several layers and paging, small enough that a CPU answers in
# milliseconds per token.
TINY_HPARAMS = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                       max_position_embeddings=2048)
UNTRAINED_NOTE = ("UNTRAINED: random weights from seed {seed}; a tiny Llama-architecture model "
                  "for development and tests. Its output text is meaningless.")


def write_random_llama(out: Path, seed: int, hp: dict = TINY_HPARAMS) -> None:
    """A Hugging Face style Llama checkpoint (config.json + model.safetensors) with random weights."""
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1, **hp,
    }
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    head_dim = h // hp["num_attention_heads"]
    kv = hp["num_key_value_heads"] * head_dim

    def rand(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + rand(h, std=0.1)

    w = {"model.embed_tokens.weight": rand(vocab, h, std=1.0), "model.norm.weight": norm(),
         "lm_head.weight": rand(vocab, h, std=0.05)}
    for i in range(hp["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(h, h, std=h ** -0.5),
              p + "self_attn.k_proj.weight": rand(kv, h, std=h ** -0.5),
              p + "self_attn.v_proj.weight": rand(kv, h, std=h ** -0.5),
              p + "self_attn.o_proj.weight": rand(h, h, std=h ** -0.5),
              p + "mlp.gate_proj.weight": rand(inter, h, std=h ** -0.5),
              p + "mlp.up_proj.weight": rand(inter, h, std=h ** -0.5),
              p + "mlp.down_proj.weight": rand(h, inter, std=inter ** -0.5),
              p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1}, indent=2) + "\n")
