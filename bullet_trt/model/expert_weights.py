"""Where a checkpoint's expert tensors go in the model's stacked expert parameters.

The model holds a MoE layer's experts as two stacked parameters under the names transformers
5 uses in memory: ``mlp.experts.gate_up_proj`` (experts, 2 * inter, hidden), every expert's
gate rows then its up rows, and ``mlp.experts.down_proj`` (experts, hidden, inter). Published
Qwen3-MoE checkpoints, and transformers' own ``save_pretrained``, store one tensor per expert
and projection instead (``mlp.experts.{e}.gate_proj.weight`` (inter, hidden), ``up_proj``,
``down_proj`` (hidden, inter)); a checkpoint that already holds the stacked tensors loads
them as they are.
"""
from __future__ import annotations

from collections.abc import Container

import torch

GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"


def _per_expert(name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    if name.endswith(GATE_UP):
        prefix, inter = name[:-len("gate_up_proj")], param.shape[1] // 2
        out = {}
        for e in range(param.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = param[e, :inter]
            out[f"{prefix}{e}.up_proj.weight"] = param[e, inter:]
        return out
    if name.endswith(DOWN):
        prefix = name[:-len("down_proj")]
        return {f"{prefix}{e}.down_proj.weight": param[e] for e in range(param.shape[0])}
    return {name: param}


def checkpoint_destinations(params: dict[str, torch.Tensor],
                            available: Container[str]) -> dict[str, torch.Tensor]:
    """{checkpoint tensor name: the parameter, or the slice of a stacked expert parameter,
    that it fills}. A parameter whose own name is ``available`` in the checkpoint is filled
    from it; a stacked expert parameter that is not, from the per-expert tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        out.update({name: param} if name in available else _per_expert(name, param))
    return out
