"""The shape of a model, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelArch:
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None means plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    torch_dtype: torch.dtype | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    sliding_window: int | None = None  # only set when it is shorter than the position limit
    # Mixture of experts (Qwen3-MoE): the layers in moe_layers route each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size; the other layers keep
    # a dense MLP of intermediate_size. Dense families leave moe_layers empty.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()
    # A fine-grained FP8 checkpoint (quantization_config quant_method "fp8", blocks of 128 x 128):
    # its linear layers' weights are E4M3 with a `weight_scale_inv` per block beside each
    fp8_checkpoint: bool = False
    # its activation_scheme is "dynamic" (the published checkpoints'): activations are rounded to
    # FP8 per token and 128 columns at run time, which quantization=fp8-w8a8 does for the experts
    fp8_dynamic_activations: bool = False
    source: str = "<dict>"  # the config file, for error messages

    @staticmethod
    def from_checkpoint(checkpoint_dir: str | Path) -> "ModelArch":
        path = Path(checkpoint_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a checkpoint directory needs a Hugging Face config.json")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return ModelArch.from_hf_dict(data, source=str(path))

    @staticmethod
    def from_hf_dict(d: dict[str, Any], source: str = "<dict>") -> "ModelArch":
        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return d[key]

        archs = d.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ValueError(f"{source}: field 'architectures' is {archs!r}; supported: {sorted(ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is implemented")

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        max_pos = int(need("max_position_embeddings"))
        rope_theta, rope_scaling = _rope_params(d, source)

        window = None
        # Qwen2/3 carry a sliding_window value that only applies when use_sliding_window is on.
        if family == "mistral" or d.get("use_sliding_window"):
            window = d.get("sliding_window")
            if window is not None and int(window) >= max_pos:
                window = None

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        dtype_name = d.get("dtype") or d.get("torch_dtype")  # transformers 5 writes "dtype"
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ValueError(f"{source}: field 'dtype' is {dtype_name!r}; supported: {sorted(_DTYPES)}")
        attention_bias = bool(d.get("attention_bias", False))
        num_layers = int(need("num_hidden_layers"))
        moe = _moe_params(d, family, num_layers, source)
        quantization_config = d.get("quantization_config")
        fp8_checkpoint = _fp8_checkpoint(quantization_config, source)
        return ModelArch(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # transformers hardcodes q/k/v biases for Qwen2 and none at all for Mistral.
            attention_bias={"qwen2": True, "mistral": False}.get(family, attention_bias),
            o_proj_bias=family in ("llama", "qwen3", "qwen3_moe") and attention_bias,
            mlp_bias=family == "llama" and bool(d.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            torch_dtype=_DTYPES[dtype_name] if dtype_name else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window is not None else None,
            **moe,
            fp8_checkpoint=fp8_checkpoint,
            fp8_dynamic_activations=fp8_checkpoint and quantization_config.get("activation_scheme") == "dynamic",
            source=source,
        )

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def expert_quantization(self, quantization: str) -> str:
        """The engine's ``quantization`` as the experts take it: none, fp8 or fp8-w8a8 (auto:
        where an FP8 checkpoint stores a mixture-of-experts model, the scheme it names: fp8-w8a8
        for dynamic activations, else fp8; none for any other checkpoint)."""
        if quantization == "auto":
            if not (self.fp8_checkpoint and self.moe_layers):
                return "none"
            return "fp8-w8a8" if self.fp8_dynamic_activations else "fp8"
        return quantization

    def fp8_experts(self, quantization: str) -> bool:
        """Whether the experts are held as FP8 blocks under the engine's ``quantization``."""
        return self.expert_quantization(quantization) != "none"

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuses contexts past the checkpoint's positions, and (sliding-window attention is not
        implemented) past its window."""
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings {self.max_position_embeddings} ({self.source})")
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise NotImplementedError(
                f"{self.source}: sliding_window={self.sliding_window} but max_model_len={max_model_len}; "
                f"sliding-window attention is not implemented, set max_model_len <= {self.sliding_window}")


def _fp8_checkpoint(quant: dict[str, Any] | None, source: str) -> bool:
    """Whether ``quantization_config`` describes the one quantized format read here: FP8 E4M3
    weights with a scale per 128 x 128 block (DeepSeek-V3's, Qwen3's "-FP8" checkpoints)."""
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "fp8":
        raise NotImplementedError(f"{source}: quantization_config.quant_method is {method!r}; "
                                  "only 'fp8' (block-wise E4M3) checkpoints are read")
    block = quant.get("weight_block_size")
    if block != [128, 128]:
        raise NotImplementedError(f"{source}: quantization_config.weight_block_size is {block!r}; "
                                  "only [128, 128] blocks are read")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NotImplementedError(f"{source}: quantization_config.fmt is {fmt!r}; only 'e4m3' is read")
    return True


def _moe_params(d: dict[str, Any], family: str, num_layers: int, source: str) -> dict[str, Any]:
    """The expert fields of ModelArch; which layers are sparse follows transformers'
    Qwen3-MoE rule: layer i is sparse unless listed in mlp_only_layers, when
    (i + 1) % decoder_sparse_step == 0."""
    if family != "qwen3_moe":
        return {}
    # transformers 5 writes num_local_experts (its attribute map); the published configs say num_experts
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    top_k = int(d.get("num_experts_per_tok") or 0)
    step = int(d.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in d.get("mlp_only_layers") or []}
    layers = tuple(i for i in range(num_layers)
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    if layers and not 0 < top_k <= experts:
        raise ValueError(f"{source}: field 'num_experts_per_tok' is {top_k}; it must be in 1..{experts}")
    inter = d.get("moe_intermediate_size")
    if layers and not inter:
        raise ValueError(f"{source}: required field 'moe_intermediate_size' is missing")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(inter or 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), moe_layers=layers)


def _rope_params(d: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the transformers 4 or 5 layout.

    transformers 4 wrote ``rope_theta`` at top level and ``rope_scaling`` (type or rope_type);
    transformers 5 writes ``rope_parameters`` holding rope_theta and rope_type together.
    """
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError(f"{source}: per-layer 'rope_parameters' are not supported")
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, params
