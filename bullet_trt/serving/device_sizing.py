"""Sizes a served engine for the GPU it runs on, so that no hand flags are needed there.

engine.yaml's decode slots (64), graphs (up to 64 rows) and chunk (512 tokens) suit two CPU
cores; a GPU serving an 8B model sustained its measured rates with 1024 decode slots, graphs
up to 1024 rows, 2048-token chunks for bullet, and for chunked 1024-token chunks whose mixed
steps replay piecewise CUDA graphs; both modes' steps launched one ahead of the last one's
tokens (decode.overlap_steps; docs/benchmarks.md); a mixture-of-experts model's prefill
worker in the spatial modes replays them too, since its eager step is bound by the host
issuing its kernels, and takes batches of up to 32 prompts, since each batch streams
every expert (docs/moe.md). With serve.sizing=auto each of those
keys that no override names is set here, inside the engine process, from:

- memory: the KV pool's share of the device (kv.gpu_memory_fraction less the weights) over
  a typical decoding row's context bounds how many rows can hold their KV at once;
- time: the performance model (the engine's calibration for this GPU, else uncalibrated defaults)
  bounds the rows whose decode step on the whole GPU stays within decode's share of the
  TPOT SLO;
- and the largest batch measured (1024 rows): beyond it nothing was checked.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from bullet_trt.config import EngineConfig
from bullet_trt.model.arch import ModelArch
from bullet_trt.serving.memory_plan import TYPICAL_CONTEXT, kv_heads_per_rank, kv_value_bytes, plan_rank
from bullet_trt.spatial.calibration_store import CalibrationKey, load_perf_model
from bullet_trt.spatial.perf_model import ModelCost

# Decode batch sizes with a CUDA graph: dense where batches are small (each padded row
# costs a whole row's attention), every 64-128 rows above.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512,
                 640, 768, 896, 1024)
MAX_DECODE_ROWS = 1024  # the largest decode batch calibrated and served so far
# The best chunk measured on an H100 and an H200 (docs/benchmarks.md): bullet's prefill fuses
# prompts up to it; chunked's mixed steps, once graphed, sustain the most at 1024 on both GPUs.
GPU_CHUNK_TOKENS = {"bullet": 2048, "static": 2048, "chunked": 1024}
MOE_PREFILL_SEQS = 32  # an MoE model's prefill batch cap in the spatial modes, as measured
PIECEWISE_STEP_TOKENS = 256  # the spacing of the piecewise graphs' token buckets, as measured


def piecewise_buckets(chunk: int) -> list[int]:
    """Token counts of the piecewise graphs, as chunked mode's measured rates ran with them and
    the spatial prefill worker of an MoE model runs them: a step of at most `chunk` tokens pads to
    the next (128, then every 256, then chunk). The worker captures each on every partition it
    may run on, which costs its server ~15 s more start than 128, 256, 512, 1024 and 2048 did,
    and no memory its log shows; a batch of 1100 tokens then pads to 1280, not 2048, and at
    Qwen3-30B-A3B's first miss with FP8 experts and activations (64 req/s on an H200) bullet
    attained 91.5% with them against 87.0% (docs/benchmarks.md, twenty-eighth round)."""
    return sorted({min(128, chunk), *range(PIECEWISE_STEP_TOKENS, chunk, PIECEWISE_STEP_TOKENS), chunk})


@dataclass(frozen=True)
class GpuFacts:
    name: str  # picks the calibration (bullet_trt/spatial/calibration_store.py)
    total_memory: int  # bytes
    total_sms: int


def decode_rows(cfg: EngineConfig, arch: ModelArch, gpu: GpuFacts, dtype_bytes: int) -> tuple[int, str]:
    """The decode slots for this device, and which bound chose them."""
    total_memory, total_sms = gpu.total_memory, gpu.total_sms
    tp = cfg.parallel.tensor_parallel_size
    # a tensor-parallel rank: its share of the step's work, its pool beside its share of the weights
    experts = arch.expert_quantization(cfg.quantization)
    fp8_experts = experts != "none"
    kv_bytes = kv_value_bytes(cfg.kv.cache_dtype, dtype_bytes)
    cost = ModelCost.from_arch(arch, dtype_bytes, fp8_experts, kv_bytes).per_rank(
        tp, kv_heads_per_rank(arch, tp), arch.num_kv_heads)
    context = min(cfg.max_model_len, TYPICAL_CONTEXT)
    by_memory = plan_rank(arch, dtype_bytes, tp, total_memory, cfg.kv.gpu_memory_fraction, context, fp8_experts,
                          kv_bytes).rows
    from bullet_trt.model.loader import resolve_dtype  # torch, only where a GPU is sized

    key = CalibrationKey.for_server(cfg, arch, gpu.name, total_sms, resolve_dtype(arch, cfg.dtype, "cuda"))
    perf, _ = load_perf_model(cfg.engine_dir, cost, key)
    budget_ms = cfg.serve.tpot_slo_ms * cfg.serve.tpot_plan_fraction
    by_time = max([b for b in GRAPH_BUCKETS if perf.decode_ms(b, b * context, total_sms) <= budget_ms],
                  default=1)
    bounds = {"memory": by_memory, "TPOT": by_time, "largest measured": MAX_DECODE_ROWS}
    reason = min(bounds, key=bounds.get)
    rows = max([b for b in GRAPH_BUCKETS if b <= bounds[reason]], default=1)
    return rows, f"{reason} ({', '.join(f'{k} {v}' for k, v in bounds.items())})"


def size_for_device(cfg: EngineConfig) -> list[str]:
    """Sets the sized keys of cfg in place for the GPU it runs on; returns what it set and why."""
    if cfg.serve.sizing != "auto" or cfg.resolve_device() == "cpu":
        return []
    import torch

    props = torch.cuda.get_device_properties(torch.device(cfg.resolve_device()))
    gpu = GpuFacts(props.name, props.total_memory, props.multi_processor_count)
    return size_for(cfg, ModelArch.from_checkpoint(cfg.checkpoint_path), gpu)


def size_for(cfg: EngineConfig, arch: ModelArch, gpu: GpuFacts) -> list[str]:
    """size_for_device for the GPU described by gpu."""
    dtype_bytes = 4 if cfg.dtype == "float32" else 2
    given = set(cfg.overridden)
    notes = []
    mode = sized_mode(cfg)
    plan = sized_tpot_plan(arch, mode)
    if "serve.tpot_plan_fraction" not in given and plan is not None:
        cfg.serve.tpot_plan_fraction = plan  # before the slots: their TPOT bound reads it
        notes.append(f"serve.tpot_plan_fraction={plan}")
    rows, why = decode_rows(cfg, arch, gpu, dtype_bytes)
    if "decode.max_num_seqs" not in given:
        cfg.decode.max_num_seqs = rows
        notes.append(f"decode.max_num_seqs={rows} (bound: {why})")
        if "decode.max_num_batched_tokens" not in given:
            cfg.decode.max_num_batched_tokens = rows
    if "decode.cuda_graph_batch_sizes" not in given:
        cfg.decode.cuda_graph_batch_sizes = [b for b in GRAPH_BUCKETS if b <= cfg.decode.max_num_seqs]
        notes.append(f"decode.cuda_graph_batch_sizes up to {cfg.decode.cuda_graph_batch_sizes[-1]}")
    if "serve.chunk_size" not in given:
        cfg.serve.chunk_size = sized_chunk(cfg, mode)
        notes.append(f"serve.chunk_size={cfg.serve.chunk_size}")
    if "prefill.piecewise_graph_tokens" not in given:
        cfg.prefill.piecewise_graph_tokens = sized_prefill_pieces(cfg, arch, mode, cfg.serve.chunk_size)
        if cfg.prefill.piecewise_graph_tokens:
            notes.append(f"prefill.piecewise_graph_tokens {cfg.prefill.piecewise_graph_tokens}")
    seqs = sized_prefill_seqs(cfg, arch, mode)
    if "prefill.max_num_seqs" not in given and seqs is not None:
        cfg.prefill.max_num_seqs = seqs
        notes.append(f"prefill.max_num_seqs={seqs}")
    if "decode.overlap_steps" not in given and sized_overlap(cfg, mode):
        cfg.decode.overlap_steps = True
        notes.append("decode.overlap_steps=true")
    return notes


def sized_mode(cfg: EngineConfig) -> str:
    return cfg.serve.mode if cfg.serve.mode in GPU_CHUNK_TOKENS else "bullet"


def sized_tpot_plan(arch: ModelArch, mode: str) -> float | None:
    """Bullet's per-step decode plan as a fraction of the TPOT SLO, where it differs from the default."""
    if mode == "bullet" and arch.moe_layers:
        # An MoE decode step of a few hundred rows reaches every expert and runs near 0.85 of
        # the SLO on the whole GPU, so that plan leaves prefill too few SMs and bullet misses
        # TTFT: Qwen3-30B-A3B on an H200, three seeds x 120 s, sustained 28 req/s at 0.85 and
        # 34 at 1.0 (TPOT p99 then 45-49 ms; docs/benchmarks.md). A dense model keeps 0.85
        # until its Azure-like loads, where nearly every step runs beside a prefill, are measured.
        return 1.0
    return None


def sized_prefill_seqs(cfg: EngineConfig, arch: ModelArch, mode: str) -> int | None:
    """The prompts one prefill batch of the spatial modes may hold, where it differs from
    engine.yaml's 8. An MoE model's prefill batch streams every expert whatever its size (beside
    decode on 32 of an H200's SMs a fixed ~60 ms of each batch, docs/moe.md), so at capacity
    its worker, busy 95-97% of the time on batches of exactly 8 prompts, fell behind; with room
    for 32 the admission (spatial/policy.py, bounded by TTFT and the token budget) formed
    batches of 9-12 and the worker kept up: Qwen3-30B-A3B on an H200 attained 97.2% at 52 req/s
    where 8 attained 59.2% (same machine and seed, docs/benchmarks.md). Static mode shares the
    worker and the admission's caps, so the baseline keeps the same batches. A dense model's
    batches are unmeasured at other caps and keep 8."""
    if mode in ("bullet", "static") and arch.moe_layers and cfg.parallel.tensor_parallel_size == 1:
        return max(cfg.prefill.max_num_seqs, MOE_PREFILL_SEQS)
    return None


def sized_overlap(cfg: EngineConfig, mode: str) -> bool:
    """Whether chunked mode's steps, and bullet's decode worker's, are launched one ahead, as SGLang
    runs its scheduler by default. Measured with them against without on H200s (docs/benchmarks.md):
    chunked-1024 over Llama-3.1-8B at TPOT <= 40 ms sustained 38 req/s against 34 (three seeds), with
    the attention metadata built in numpy 40, and 44 on an H100 against 26 (one seed); over
    Qwen3-30B-A3B at TPOT <= 50 ms 34 against 24, and bullet there 40 against 34 (three seeds each
    at the held rate); bullet over Llama-3.1-8B at TPOT <= 40 ms attained 88% at 50 req/s against
    55%. No load measured lost with them: the MoE's Azure-conversation-like 20 fails both ways (46%
    one ahead, 49% over three seeds without). The loops run on one GPU only; static mode's is
    unmeasured."""
    return mode in ("chunked", "bullet") and cfg.parallel.tensor_parallel_size == 1


def sized_chunk(cfg: EngineConfig, mode: str) -> int:
    return min(GPU_CHUNK_TOKENS[mode], cfg.prefill.max_num_batched_tokens)


def served_chunk(cfg: EngineConfig, mode: str) -> int:
    """The chunk a sized server of `mode` runs: the user's, else the sized one."""
    return cfg.serve.chunk_size if "serve.chunk_size" in cfg.overridden else sized_chunk(cfg, mode)


def sized_prefill_pieces(cfg: EngineConfig, arch: ModelArch, mode: str, chunk: int) -> list[int]:
    """The piecewise graphs' token buckets for the prefill steps of `mode` at `chunk`."""
    if mode == "chunked":
        return piecewise_buckets(chunk)
    if arch.moe_layers and cfg.parallel.tensor_parallel_size == 1:
        # An MoE model's eager prefill is host-bound at every size served (Qwen3-30B-A3B on
        # an H200, 128 tokens: 42 ms eager, 15 ms graphed; 2048: 60 and 48). A dense one's
        # gains only below ~768 tokens (Llama-3.1-8B on an H100: 1.9x at 128, 0.93-0.98x from
        # 768 to 2048), where bullet's prefill batches near capacity are not (median 1072
        # tokens): it stays eager. Pieces run on one rank only (engine/session.py).
        return piecewise_buckets(chunk)
    return []


def report(notes: list[str]) -> None:
    if notes:
        print("bullet_trt: sized for this GPU (serve.sizing=engine keeps engine.yaml's values): "
              + "; ".join(notes), file=sys.stderr, flush=True)
