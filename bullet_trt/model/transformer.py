"""One decoder-only transformer for the Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE families.

Parameter names are exactly the Hugging Face ones, so a checkpoint's state dict (or one shared
from another process) plugs in without renaming. Attention runs over the paged KV cache through
the kernel ops, so the same forward serves whole prefills, prefill chunks and decode steps.

q/k/v and gate/up are separate parameters under their HF names, but placement lays each group
out back to back in one allocation, and the forward runs the group as one GEMM over that
allocation: at decode's small batch a GEMM is bound by reading its weights, and one wide GEMM
reads them at a higher rate than three narrow ones. Views shared with another process keep the
layout (CUDA IPC and shared memory share whole allocations), so workers fuse too; tensors that
do not lie back to back (attached from elsewhere) fall back to one GEMM each.

A mixture-of-experts layer (Qwen3-MoE) holds its experts as two stacked parameters under
transformers' names, ``experts.gate_up_proj`` (experts, 2 * inter, hidden) and
``experts.down_proj`` (experts, hidden, inter), which the kernels' ``fused_moe`` runs as one
grouped GEMM over the tokens sorted by expert (docs/moe.md).

Under tensor parallelism (``shard``, model/tensor_parallel.py) every layer is built with this
rank's share of the heads, columns, experts and vocabulary, and the forward all-reduces after
the row-parallel projections, the MoE layers and the embedding, and gathers the logits.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from bullet_trt.kernels import AttentionMetadata, fp8_blocks, ops_for
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.expert_weights import Fp8Target, scale_name
from bullet_trt.model.rope import build_cos_sin_cache
from bullet_trt.model.tensor_parallel import Collectives, Shard


# (module attribute holding the fused view, the HF projections it covers, in order)
FUSED_GROUPS = {"self_attn": ("qkv", ("q_proj", "k_proj", "v_proj")),
                "mlp": ("gate_up", ("gate_proj", "up_proj"))}


def back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One view of contiguous tensors that follow each other in one storage (rows stacked),
    or None when they do not."""
    first = parts[0]
    if first.device.type == "meta":
        return None
    base, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != offset):
            return None
        offset += t.numel()
    # Contiguous parts with equal trailing dims: the stacked view has the first part's strides.
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _fused_linear(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None] | None,
                  layers: list[nn.Linear]) -> torch.Tensor:
    if fused is not None:
        return F.linear(x, *fused)
    return torch.cat([layer(x) for layer in layers], dim=-1)


def _row_parallel(x: torch.Tensor, layer: nn.Linear, tp: Collectives) -> torch.Tensor:
    """A row-parallel projection: this rank's partial product, summed over the ranks; the
    bias, which every rank holds, is added once to the sum."""
    if tp.shard.single:
        return layer(x)
    out = tp.all_reduce(F.linear(x, layer.weight))
    return out if layer.bias is None else out + layer.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, tp: Collectives):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = tp.shard.q_heads(arch)[1], tp.shard.kv_heads(arch)[1]
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim ** -0.5
        q_size, kv_size = self.num_heads * arch.head_dim, self.num_kv_heads * arch.head_dim
        self.q_proj = nn.Linear(arch.hidden_size, q_size, bias=arch.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, kv_size, bias=arch.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv = None  # (weight, bias) views over q/k/v when they lie back to back
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def project(self, ops, x: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the new tokens, normed and rotated: work of each token alone, which a
        CUDA graph of a fixed token count can hold (engine/piecewise_graphs.py)."""
        T = x.shape[0]
        qkv = _fused_linear(x, self.qkv, [self.q_proj, self.k_proj, self.v_proj])
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            # each head's row where it lies in qkv (the GPU kernel reads the view; a reshape copied it)
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.apply_rope(q, k, positions, cos_sin)
        return q, k, v

    def attend(self, ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The new K/V into the paged cache, then attention over each sequence's context: the
        part of a step whose launch shapes follow the batch's sequences, not its token count."""
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = ops.paged_attention(q, kv_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return _row_parallel(attended, self.o_proj, self.tp)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: Collectives):
        super().__init__()
        self.tp = tp
        inter = tp.shard.mlp_columns(arch.intermediate_size)[1]
        self.gate_proj = nn.Linear(arch.hidden_size, inter, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(arch.hidden_size, inter, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=arch.mlp_bias)
        self.gate_up = None  # (weight, bias) views over gate/up when they lie back to back

    def forward(self, ops, x: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`real_rows`: as in SparseMoeBlock; a dense MLP costs padded rows the same either way."""
        act = ops.silu_and_mul(_fused_linear(x, self.gate_up, [self.gate_proj, self.up_proj]))
        return _row_parallel(act, self.down_proj, self.tp)


class Experts(nn.Module):
    """The experts of one MoE layer, stacked: this rank's range of them under tensor
    parallelism (``expert_offset`` is the first expert it holds), all of them on one rank.
    ``store_in_fp8`` turns them into FP8 blocks with their scales (kernels/fp8_blocks.py)."""

    def __init__(self, arch: ModelArch, shard: Shard):
        super().__init__()
        self.expert_offset, e = shard.experts(arch)
        h, inter = arch.hidden_size, arch.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)
        self.fp8_activations = False  # the products' inputs rounded to FP8 too (quantization=fp8-w8a8)

    def store_in_fp8(self, activations: bool = False) -> None:
        """Re-declares the (not yet filled) weights as FP8, with a float32 scale per block;
        ``activations``: the experts' inputs are rounded to FP8 as each step runs."""
        self.fp8_activations = activations
        e, two_inter, h = self.gate_up_proj.shape
        inter, device = two_inter // 2, self.gate_up_proj.device

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        rows, cols = fp8_blocks.scale_shape(inter, h)
        self.gate_up_proj = param(e, two_inter, h, dtype=fp8_blocks.FP8)
        self.gate_up_scale = param(e, 2 * rows, cols, dtype=torch.float32)
        self.down_proj = param(e, h, inter, dtype=fp8_blocks.FP8)
        self.down_scale = param(e, *fp8_blocks.scale_shape(h, inter), dtype=torch.float32)


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts of a Qwen3-MoE layer. Under tensor parallelism every rank
    routes every token and runs the assignments to its own experts; the sum over the ranks is
    the layer's output."""

    def __init__(self, arch: ModelArch, tp: Collectives):
        super().__init__()
        self.tp = tp
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch, tp.shard)
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob

    def forward(self, ops, x: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`real_rows`: a one-element tensor, how many leading rows of `x` are real where the rest
        pad a step to a graph's token bucket (engine/piecewise_graphs.py); the padded rows go to
        no expert and come out zero. Routed, they would cost the experts what as many real tokens
        cost, all on the same k experts (the padded rows are identical)."""
        weights, ids = ops.moe_route(self.gate(x), self.top_k, self.renormalize)
        if real_rows is not None:
            ids = unrouted_past(ids, real_rows)
        e = self.experts
        return self.tp.all_reduce(ops.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, e.expert_offset,
                                                e.gate_up_scale, e.down_scale, e.fp8_activations))


NO_EXPERT = -1  # an expert id outside every rank's range: fused_moe leaves the assignment out


def unrouted_past(ids: torch.Tensor, real_rows: torch.Tensor) -> torch.Tensor:
    """`ids` (T, k) with the rows from real_rows[0] on sent to no expert; graph-safe (the count
    is read on the device, so one captured graph serves every count)."""
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    return torch.where(rows < real_rows, ids, NO_EXPERT)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int, tp: Collectives):
        super().__init__()
        self.self_attn = Attention(arch, tp)
        self.mlp = SparseMoeBlock(arch, tp) if arch.is_moe_layer(index) else MLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, arch: ModelArch, tp: Collectives):
        super().__init__()
        self.embed_tokens = nn.Embedding(tp.shard.vocab_rows(arch), arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """The model. Parameters start uninitialized (built on meta, then placed): fill them with
    ``loader.load_checkpoint``, ``attach_weights`` or ``init_random_weights``.

    ``shard``: the part of the model this rank holds (all of it by default); ``group``: the
    torch.distributed process group of its ranks (None: the default group);
    ``collectives_in_graphs``: its collectives may be captured into CUDA graphs (Collectives);
    ``fp8_experts``: the MoE experts' weights are FP8 blocks (kernels/fp8_blocks.py), the rest
    ``dtype``; ``fp8_activations``: their inputs are rounded to FP8 too, as each step runs.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None, shard: Shard = Shard(), group=None,
                 collectives_in_graphs: bool = False, fp8_experts: bool = False, fp8_activations: bool = False):
        super().__init__()
        shard.check(arch)
        if fp8_experts and not arch.moe_layers:
            raise ValueError(f"FP8 experts: {arch.source or 'the model'} has no MoE layers")
        if fp8_activations and not fp8_experts:
            raise ValueError("FP8 activations go with FP8 experts")
        self.arch, self.dtype, self.shard = arch, dtype, shard
        self.fp8_experts, self.fp8_activations = fp8_experts, fp8_activations
        self.tp = Collectives(shard, group, collectives_in_graphs)
        self.max_positions = max_positions or arch.max_position_embeddings
        # Built on meta, so no time goes into random init that the loader overwrites anyway.
        with torch.device("meta"):
            self.model = Model(arch, self.tp)
            if not arch.tie_word_embeddings:
                self.lm_head = nn.Linear(arch.hidden_size, shard.vocab_rows(arch), bias=False)
        self.to(dtype).requires_grad_(False)
        if fp8_experts:
            for module in self.modules():
                if isinstance(module, Experts):
                    module.store_in_fp8(fp8_activations)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self._place(torch.device(device))

    def _place(self, device: torch.device) -> None:
        """Puts parameters (uninitialized) and the RoPE table on ``device``; picks the kernels."""
        if device.type == "cuda" and device.index is None:
            # Tensors report "cuda:N"; a bare "cuda" would never compare equal to them.
            device = torch.device("cuda", torch.cuda.current_device())
        if any(p.device != device for p in self.parameters()):
            self.to_empty(device=device)
            self.requires_grad_(False)
            self._lay_out_fused_groups()
        self._find_fused_groups()
        self.device = device
        self.ops = ops_for(device)
        self.cos_sin_cache = build_cos_sin_cache(self.arch, self.max_positions, device)

    def _fused_group_members(self):
        """(module, fused attribute, the member nn.Linear layers) for every fusable group."""
        for layer in self.model.layers:
            for child, (attr, names) in FUSED_GROUPS.items():
                module = getattr(layer, child)
                if isinstance(module, SparseMoeBlock):
                    continue  # its experts are stacked already
                yield module, attr, [getattr(module, n) for n in names]

    def _lay_out_fused_groups(self) -> None:
        """Re-allocates each group's (uninitialized) weights and biases as row slices of one
        tensor; loading then fills the slices."""
        for _, _, members in self._fused_group_members():
            for leaf in ("weight", "bias"):
                parts = [getattr(m, leaf) for m in members]
                if parts[0] is None:
                    continue
                whole = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                    dtype=parts[0].dtype, device=parts[0].device)
                for m, piece in zip(members, whole.split([p.shape[0] for p in parts])):
                    m._parameters[leaf] = nn.Parameter(piece, requires_grad=False)

    def _find_fused_groups(self) -> None:
        for module, attr, members in self._fused_group_members():
            weight = back_to_back([m.weight for m in members])
            bias = back_to_back([m.bias for m in members]) if members[0].bias is not None else None
            usable = weight is not None and (members[0].bias is None or bias is not None)
            setattr(module, attr, (weight, bias) if usable else None)

    @property
    def fused_groups(self) -> int:
        """How many projection groups run as one GEMM (2 per layer when all are fused; 1 per
        MoE layer, whose MLP is its stacked experts)."""
        return sum(getattr(module, attr) is not None for module, attr, _ in self._fused_group_members())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (T, hidden) of the packed new tokens; writes their K/V into kv_caches.

        kv_caches: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
        """
        hidden, residual = self._embed(input_ids), None
        for i in range(len(self.model.layers)):
            q, k, v, residual = self.layer_head(i, hidden, residual, positions)
            attended = self.layer_attention(i, q, k, v, kv_caches, meta)
            hidden, residual = self.layer_tail(i, attended, residual)
        return self.finish(hidden, residual)

    # The forward in pieces: piecewise CUDA graphs (engine/piecewise_graphs.py) capture all but
    # layer_attention and run that between them, so they must compose exactly as above.
    def layer_head(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None,
                   positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i up to attention: the input norm (adding the residual stream after layer 0),
        then q, k, v. Returns (q, k, v, residual)."""
        layer = self.model.layers[i]
        norm = layer.input_layernorm
        if residual is None:
            x, residual = self.ops.rms_norm(hidden, norm.weight, norm.eps), hidden
        else:
            x, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        q, k, v = layer.self_attn.project(self.ops, x, positions, self.cos_sin_cache)
        return q, k, v, residual

    def layer_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.layers[i].self_attn.attend(self.ops, q, k, v, kv_caches[i], meta)

    def layer_tail(self, i: int, attended: torch.Tensor, residual: torch.Tensor,
                   real_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after attention: o_proj, the residual add and norm, the MLP (or experts).
        Returns (hidden, residual). `real_rows`: where the rows are padded (SparseMoeBlock)."""
        layer = self.model.layers[i]
        hidden = layer.self_attn.output(attended)
        norm = layer.post_attention_layernorm
        x, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return layer.mlp(self.ops, x, real_rows), residual

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        norm = self.model.norm
        return self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; split by vocabulary, each rank looks up the tokens of its own
        range (zero for the others) and the sum over the ranks is every token's row."""
        table = self.model.embed_tokens.weight
        if self.shard.single:
            return F.embedding(input_ids, table)
        first, count = self.shard.vocab(self.arch)
        local = input_ids - first
        inside = (local >= 0) & (local < count)
        rows = F.embedding(torch.where(inside, local, torch.zeros_like(local)), table)
        return self.tp.all_reduce(rows * inside.unsqueeze(1).to(rows.dtype))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits over the whole vocabulary (gathered from every rank under tensor
        parallelism); with ``out`` (model dtype, (T, vocab)) they are written there in the
        model's dtype instead, for CUDA graphs that need a fixed output buffer."""
        weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        if not self.shard.single:
            logits = self.tp.gather_vocab(F.linear(hidden, weight), self.arch.vocab_size)
            return logits.float() if out is None else out.copy_(logits)
        if out is None:
            return F.linear(hidden, weight).float()
        return torch.matmul(hidden, weight.t(), out=out)

    def attach_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Makes the given tensors the parameters, sharing their storage (no copy).

        Used to adopt weights that another process put in shared memory or CUDA IPC handles.
        All tensors must be on one device and in the parameters' dtypes (the model's, FP8
        experts' their own).
        """
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        extra = sorted(set(state) - set(params))
        if missing or extra:
            raise ValueError(f"attach_weights: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
        devices = {t.device for t in state.values()}
        if len(devices) != 1:
            raise ValueError(f"attach_weights: tensors are on several devices {sorted(map(str, devices))}")
        for name, tensor in state.items():
            if tensor.shape != params[name].shape:
                raise ValueError(f"attach_weights: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            if tensor.dtype != params[name].dtype:
                raise ValueError(f"attach_weights: tensor {name} is {tensor.dtype}, expected {params[name].dtype}")
        for name, tensor in state.items():
            owner, _, leaf = name.rpartition(".")
            self.get_submodule(owner)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        device = devices.pop()
        if device != self.device:
            self._place(device)
        else:
            self._find_fused_groups()

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> None:
        """Random weights for engines without a trained checkpoint (dummy weights), drawn on
        the model's device (an 8B model in seconds on a GPU) and scaled so activations keep
        unit size through the layers. A tensor-parallel rank draws each whole tensor and keeps
        its slice, so that its shard is the one-rank model's, whatever the number of ranks."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        params = dict(self.named_parameters())
        for name, p in params.items():
            if name.endswith("_scale"):
                continue  # an FP8 weight's scales: made with it, below
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                part = self.shard.checkpoint_slice(name, self.arch)
                shape = list(p.shape)
                if part is not None:
                    shape[part.dim] = part.full
                fp8 = p.dtype == fp8_blocks.FP8
                # an FP8 expert: drawn as the model's dtype would draw it, then quantized
                whole = p if part is None and not fp8 else p.new_empty(shape, dtype=self.dtype)
                whole.normal_(0.0, 1.0 if "embed_tokens" in name else shape[-1] ** -0.5, generator=gen)
                if fp8:
                    mine = whole if part is None else whole.narrow(part.dim, part.start, part.stop - part.start)
                    Fp8Target(p, params[scale_name(name)], gate_up=name.endswith("gate_up_proj")).fill(mine)
                elif part is not None:
                    rows = part.stop - part.start
                    p.zero_().narrow(part.dim, 0, rows).copy_(whole.narrow(part.dim, part.start, rows))
