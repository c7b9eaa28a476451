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
"""
from __future__ import annotations

import re
from collections.abc import Container

import torch

GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"


_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _per_expert(name: str, param: torch.Tensor, offset: int) -> dict[str, torch.Tensor]:
    if name.endswith(GATE_UP):
        prefix, inter = name[:-len("gate_up_proj")], param.shape[1] // 2
        out = {}
        for e in range(param.shape[0]):
            out[f"{prefix}{offset + e}.gate_proj.weight"] = param[e, :inter]
            out[f"{prefix}{offset + e}.up_proj.weight"] = param[e, inter:]
        return out
    if name.endswith(DOWN):
        prefix = name[:-len("down_proj")]
        return {f"{prefix}{offset + e}.down_proj.weight": param[e] for e in range(param.shape[0])}
    return {name: param}


def checkpoint_destinations(params: dict[str, torch.Tensor], available: Container[str],
                            expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """{checkpoint tensor name: the parameter, or the slice of a stacked expert parameter,
    that it fills}. A parameter whose own name is ``available`` in the checkpoint is filled
    from it; a stacked expert parameter that is not, from the per-expert tensors of the
    experts it holds (``expert_offset`` onwards)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        out.update({name: param} if name in available else _per_expert(name, param, expert_offset))
    return out


def is_expert_tensor(name: str, moe_layers: Container[int], num_experts: int) -> bool:
    """Whether ``name`` is a per-expert tensor of one of the model's experts: one that some
    rank loads, though under tensor parallelism perhaps not this one."""
    m = _PER_EXPERT.search(name)
    return m is not None and int(m.group(1)) in moe_layers and int(m.group(2)) < num_experts
