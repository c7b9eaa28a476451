"""Tensor parallelism inside the model: which slice of every weight a rank holds (`Shard`) and
the collectives its forward runs (`Collectives`).

The split is Megatron's. q/k/v and gate/up are column-parallel: a rank computes the outputs of
its own heads and MLP columns from the whole hidden state. o_proj and down_proj are
row-parallel: a rank multiplies its slice of their inputs, and the ranks' partial sums are
all-reduced (the bias, held by every rank, added once after). KV heads split like the q heads
while there are at least as many as ranks; with fewer, each rank keeps the KV head its q heads
read, so the K/V projections and the cache of that head are replicated. An MoE layer's experts
split by range, each rank running its experts whole (``Experts.expert_offset``), the router
replicated and the layer's output all-reduced. The embedding and the lm_head split the
vocabulary in equal ranges (the last padded with zero rows): a token's embedding comes from
the rank holding its row and is all-reduced, and the logits of every range are gathered on
every rank, so that all of them sample the same token from the same numbers.

Norms and everything else not named here are replicated. `memory_plan.py` sizes a rank from
the same rules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bullet_trt.model.arch import ModelArch


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a rank reads: ``start:stop`` along ``dim``, whose full
    length is ``full``."""

    dim: int
    start: int
    stop: int
    full: int


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    @property
    def single(self) -> bool:
        return self.size == 1

    def check(self, arch: ModelArch) -> None:
        """Raises ValueError naming the first dimension that does not split ``size`` ways."""
        n = self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {n}")
        if n == 1:
            return
        where = f"{arch.source}: parallel.tensor_parallel_size={n}"
        if arch.num_heads % n:
            raise ValueError(f"{where} does not divide the {arch.num_heads} attention heads")
        kv = arch.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ValueError(f"{where}: the {kv} KV heads neither split evenly nor replicate "
                             f"evenly over the ranks")
        dense = [i for i in range(arch.num_layers) if not arch.is_moe_layer(i)]
        if dense and arch.intermediate_size % n:
            raise ValueError(f"{where} does not divide intermediate_size {arch.intermediate_size}")
        if arch.moe_layers and arch.num_experts % n:
            raise ValueError(f"{where} does not divide the {arch.num_experts} experts")

    def _range(self, total: int) -> tuple[int, int]:
        per = total // self.size
        return self.rank * per, per

    def q_heads(self, arch: ModelArch) -> tuple[int, int]:
        """(first q head, how many) of this rank."""
        return self._range(arch.num_heads)

    def kv_heads(self, arch: ModelArch) -> tuple[int, int]:
        kv = arch.num_kv_heads
        if kv >= self.size:
            return self._range(kv)
        return self.rank // (self.size // kv), 1  # the head this rank's q heads read

    def mlp_columns(self, total: int) -> tuple[int, int]:
        return self._range(total)

    def experts(self, arch: ModelArch) -> tuple[int, int]:
        return self._range(arch.num_experts)

    def vocab_rows(self, arch: ModelArch) -> int:
        """Rows of the embedding and lm_head every rank holds (the last rank's tail padded)."""
        return -(-arch.vocab_size // self.size)

    def vocab(self, arch: ModelArch) -> tuple[int, int]:
        """(first token id, how many real rows) of this rank."""
        per = self.vocab_rows(arch)
        first = self.rank * per
        return first, max(0, min(per, arch.vocab_size - first))

    def checkpoint_slice(self, name: str, arch: ModelArch) -> Slice | None:
        """The part of checkpoint tensor ``name`` this rank loads; None: all of it (replicated,
        or a per-expert tensor, which only the rank holding that expert loads)."""
        if self.single:
            return None
        if ".mlp.experts." in name:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked experts
                first, n = self.experts(arch)
                return Slice(0, first, first + n, arch.num_experts)
            return None
        hd = arch.head_dim

        def span(dim: int, first_count: tuple[int, int], unit: int, total: int) -> Slice:
            first, count = first_count
            return Slice(dim, first * unit, (first + count) * unit, total * unit)

        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return span(0, self.q_heads(arch), hd, arch.num_heads)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return span(0, self.kv_heads(arch), hd, arch.num_kv_heads)
        if name.endswith("o_proj.weight"):
            return span(1, self.q_heads(arch), hd, arch.num_heads)
        inter = arch.intermediate_size
        if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
            return span(0, self.mlp_columns(inter), 1, inter)
        if name.endswith("down_proj.weight"):
            return span(1, self.mlp_columns(inter), 1, inter)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            first, count = self.vocab(arch)
            return Slice(0, first, first + count, arch.vocab_size)
        return None


class Collectives:
    """The model's communication with the other ranks of its shard: nothing at all on one rank.
    ``group`` is the torch.distributed process group of the ranks (None: the default one).
    ``in_graphs``: the collectives may be captured into CUDA graphs, so that a sharded model's
    decode steps replay graphs as one GPU's do. NCCL's can be (each rank captures the same
    graphs in the same order, and replays them in the same order, since every replay of a
    captured all-reduce pairs with the other ranks' like an eager call); gloo's cannot."""

    def __init__(self, shard: Shard, group=None, in_graphs: bool = False):
        self.shard = shard
        self.group = group
        self.in_graphs = in_graphs and not shard.single

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place."""
        if not self.shard.single:
            import torch.distributed as dist
            dist.all_reduce(t, group=self.group)
        return t

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(T, vocab_size) from every rank's (T, rows) range of the vocabulary."""
        if self.shard.single:
            return local
        import torch.distributed as dist
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]
