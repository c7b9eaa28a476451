"""Hyperparameters of real architectures, for engines with random (dummy) weights: benchmarks
of the real shapes without downloading a checkpoint. Values as published in each model's
config.json."""
from __future__ import annotations

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    # 30.5B parameters, 3.3B active: 128 experts per layer, 8 routed per token
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151645},
    # 235B parameters, 22B active: the seeds' large mixture-of-experts run (TP=8)
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151645},
}
