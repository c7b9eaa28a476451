"""One copy of the weights and one KV pool, built once and attached by every session.

`SharedEngineState` pickles through torch.multiprocessing: CPU tensors travel as shared
memory handles and CUDA tensors as CUDA IPC handles, so a worker process that unpickles it
maps the same memory instead of copying it.

Under tensor parallelism each rank builds its own: its shard of the weights and a pool of its
KV heads, with as many blocks as every rank can hold (block ids mean the same on all ranks).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from bullet_trt.config import EngineConfig, ProfileConfig
from bullet_trt.engine.kv_pool import blocks_for_tokens, create_kv_pool, kv_cache_dtype, size_pool
from bullet_trt.engine.session import TorchSession
from bullet_trt.engine.validation import RequestLimits
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.loader import load_checkpoint, resolve_dtype
from bullet_trt.model.tensor_parallel import Shard
from bullet_trt.model.transformer import CausalLM


@dataclass
class SharedEngineState:
    arch: ModelArch
    dtype: torch.dtype
    weights: dict[str, torch.Tensor]
    kv_pool: torch.Tensor
    block_size: int
    max_model_len: int
    shard: Shard = Shard()
    # parallel.decode_graphs: whether the sessions attached to this state capture the
    # collectives in their decode graphs (each process rebuilds the model around the weights)
    collectives_in_graphs: bool = False
    # the experts as the engine's quantization has them: none, fp8 (FP8 weights) or fp8-w8a8
    expert_quantization: str = "none"

    @property
    def fp8_experts(self) -> bool:
        return self.expert_quantization != "none"

    @property
    def fp8_activations(self) -> bool:
        return self.expert_quantization == "fp8-w8a8"

    @property
    def num_blocks(self) -> int:
        return int(self.kv_pool.shape[2])


def build_shared_state(cfg: EngineConfig, share: bool = True, tp=None) -> tuple[SharedEngineState, CausalLM]:
    """Loads the checkpoint and allocates the pool; returns the state and the loaded model.
    ``tp`` (engine.tp_group.TPGroup): this rank's shard, on its device; every rank of the group
    calls this together (the ranks agree on the pool's block count)."""
    device = tp.device if tp is not None else torch.device(cfg.resolve_device())
    shard = tp.shard if tp is not None else Shard()
    arch = ModelArch.from_checkpoint(cfg.checkpoint_path)
    arch.check_max_model_len(cfg.max_model_len)
    bs = cfg.kv.block_size
    if device.type == "cuda" and bs & (bs - 1):
        raise ValueError(f"kv.block_size must be a power of two on GPU (the Triton attention "
                         f"kernels tile blocks by powers of two), got {bs}")
    dtype = resolve_dtype(arch, cfg.dtype, device)
    kv_dtype = kv_cache_dtype(cfg.kv.cache_dtype, dtype, device)  # before the weights load: fails fast
    in_graphs = cfg.parallel.decode_graphs and device.type == "cuda"
    experts = arch.expert_quantization(cfg.quantization)
    fp8_experts = experts != "none"
    if fp8_experts and not arch.moe_layers:
        raise ValueError(f"quantization=fp8 holds a mixture-of-experts model's experts in FP8; "
                         f"{cfg.checkpoint_path} has no MoE layers")
    model = CausalLM(arch, dtype, device, max_positions=cfg.max_model_len, shard=shard,
                     group=tp.model_group if tp is not None else None, collectives_in_graphs=in_graphs,
                     fp8_experts=fp8_experts, fp8_activations=experts == "fp8-w8a8")
    if cfg.dummy_weights:
        model.init_random_weights(cfg.seed)
    else:
        load_checkpoint(model, cfg.checkpoint_path, dtype)
    weights = {name: p.data for name, p in model.named_parameters()}
    if share and device.type == "cpu":
        for t in weights.values():
            t.share_memory_()
    num_blocks = size_pool(arch, cfg.kv.block_size, kv_dtype, device, cfg.kv.num_blocks,
                           cfg.kv.gpu_memory_fraction, cfg.kv.cpu_pool_mib,
                           min_blocks=blocks_for_tokens(cfg.max_model_len, cfg.kv.block_size), shard=shard)
    if tp is not None:
        num_blocks = tp.min(num_blocks)
    pool = create_kv_pool(arch, num_blocks, cfg.kv.block_size, kv_dtype, device, shared=share, shard=shard)
    if tp is None or tp.rank == 0:
        print(f"bullet_trt: KV pool: {num_blocks} blocks of {cfg.kv.block_size} tokens ({num_blocks * cfg.kv.block_size} "
              f"tokens, {pool.numel() * pool.element_size() / 2**30:.2f} GiB{' a rank' if tp is not None else ''}, "
              f"{str(kv_dtype).removeprefix('torch.')})", file=sys.stderr, flush=True)
    state = SharedEngineState(arch, dtype, weights, pool, cfg.kv.block_size, cfg.max_model_len, shard, in_graphs,
                              experts)
    return state, model


def attach_session(state: SharedEngineState, profile: ProfileConfig, group=None) -> TorchSession:
    """A session over already-built weights and pool (in this or another process); ``group``:
    the process group of the state's tensor-parallel ranks, joined in this process."""
    model = CausalLM(state.arch, state.dtype, "meta", max_positions=state.max_model_len, shard=state.shard,
                     group=group, collectives_in_graphs=state.collectives_in_graphs, fp8_experts=state.fp8_experts,
                     fp8_activations=state.fp8_activations)
    model.attach_weights(state.weights)
    return TorchSession(model, state.kv_pool, state.block_size, profile)


def request_limits(cfg: EngineConfig, state: SharedEngineState) -> RequestLimits:
    """What a request may ask of an engine built over this state."""
    return RequestLimits(cfg.max_model_len, vocab_size=state.arch.vocab_size, kv_blocks=state.num_blocks,
                         block_size=state.block_size)


def release_device_memory(device: torch.device) -> None:
    """Hands the allocator's cached blocks back, so that a following engine in the same process
    sizes its pool from the memory this one freed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
