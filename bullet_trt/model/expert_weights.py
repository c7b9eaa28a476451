"""Where a checkpoint's expert tensors go in the model's stacked expert parameters.

The model holds a MoE layer's experts as two stacked parameters under the names transformers
5 uses in memory: ``mlp.experts.gate_up_proj`` (experts, 2 * inter, hidden), every expert's
gate rows then its up rows, and ``mlp.experts.down_proj`` (experts, hidden, inter). Published
Qwen3-MoE checkpoints, and transformers' own ``save_pretrained``, store one tensor per expert
and projection instead (``mlp.experts.{e}.gate_proj.weight`` (inter, hidden), ``up_proj``,
``down_proj`` (hidden, inter)); a checkpoint that already holds the stacked tensors loads
them as they are.

Under tensor parallelism a rank's stacked parameters hold only its range of experts, starting
at ``expert_offset``; the per-expert tensors of the other ranks' experts are theirs to load.

Experts stored in FP8 (``CausalLM(fp8_experts=True)``) are quantized as they load: each
checkpoint tensor goes to an ``Fp8Target``, its FP8 blocks into the weight and their scales into
the scale parameter beside it (``..._scale``), which no checkpoint tensor fills by name.
"""
from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass

import torch

from bullet_trt.kernels import fp8_blocks

GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"


@dataclass
class Fp8Target:
    """Where a checkpoint tensor of an FP8 expert goes: its blocks into ``weight``, their scales
    into ``scale``; ``gate_up``: a stacked gate-and-up tensor, whose halves quantize apart."""
    weight: torch.Tensor
    scale: torch.Tensor
    gate_up: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def fill(self, w: torch.Tensor) -> None:
        w = w.to(self.weight.device)
        q, s = fp8_blocks.quantize_gate_up(w) if self.gate_up else fp8_blocks.quantize(w)
        self.weight.copy_(q)
        self.scale.copy_(s)


def scale_name(weight_name: str) -> str:
    """The scale parameter of an FP8 expert weight (``gate_up_proj`` -> ``gate_up_scale``)."""
    return weight_name.removesuffix("_proj") + "_scale"


_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _per_expert(name: str, param: torch.Tensor, scale: torch.Tensor | None,
                offset: int) -> dict[str, torch.Tensor | Fp8Target]:
    def target(weight, weight_scale):
        return weight if scale is None else Fp8Target(weight, weight_scale)

    if name.endswith(GATE_UP):
        prefix, inter = name[:-len("gate_up_proj")], param.shape[1] // 2
        half = scale.shape[1] // 2 if scale is not None else 0  # the gate's scale rows, then the up's
        out = {}
        for e in range(param.shape[0]):
            out[f"{prefix}{offset + e}.gate_proj.weight"] = target(param[e, :inter], scale[e, :half] if half else None)
            out[f"{prefix}{offset + e}.up_proj.weight"] = target(param[e, inter:], scale[e, half:] if half else None)
        return out
    if name.endswith(DOWN):
        prefix = name[:-len("down_proj")]
        return {f"{prefix}{offset + e}.down_proj.weight": target(param[e], scale[e] if scale is not None else None)
                for e in range(param.shape[0])}
    return {name: param}


def checkpoint_destinations(params: dict[str, torch.Tensor], available: Container[str],
                            expert_offset: int = 0) -> dict[str, torch.Tensor | Fp8Target]:
    """{checkpoint tensor name: the parameter, or the slice of a stacked expert parameter,
    that it fills, or the Fp8Target of an FP8 expert's}. A parameter whose own name is
    ``available`` in the checkpoint is filled from it; a stacked expert parameter that is not,
    from the per-expert tensors of the experts it holds (``expert_offset`` onwards)."""
    out: dict[str, torch.Tensor | Fp8Target] = {}
    for name, param in params.items():
        if name.endswith(("experts.gate_up_scale", "experts.down_scale")):
            continue  # filled with its weight
        scale = params.get(scale_name(name)) if name.endswith((GATE_UP, DOWN)) else None
        if name in available:
            out[name] = param if scale is None else Fp8Target(param, scale, gate_up=name.endswith(GATE_UP))
        else:
            out.update(_per_expert(name, param, scale, expert_offset))
    return out


def is_expert_tensor(name: str, moe_layers: Container[int], num_experts: int) -> bool:
    """Whether ``name`` is a per-expert tensor of one of the model's experts: one that some
    rank loads, though under tensor parallelism perhaps not this one."""
    m = _PER_EXPERT.search(name)
    return m is not None and int(m.group(1)) in moe_layers and int(m.group(2)) < num_experts
