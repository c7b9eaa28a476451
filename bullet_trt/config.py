"""One typed configuration for an engine directory and for serving.

An engine directory holds ``engine.yaml`` (written by ``build_engines.py``) next to, or
pointing at, a Hugging Face checkpoint. Values load with ``yaml.safe_load`` and can be
overridden with dotted keys (``kv.block_size=32``) from the CLI or the Triton model config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENGINE_FILE = "engine.yaml"
QUANTIZATIONS = ("auto", "none", "fp8", "fp8-w8a8")
KV_CACHE_DTYPES = ("auto", "fp8")
# The fewest SMs a phase may run on beside the other (ServeConfig.min_phase_sms says why).
SMALLEST_PHASE_SMS = 16


class ConfigError(ValueError):
    """A configuration value is missing or outside its limits; the message names it."""


@dataclass
class ProfileConfig:
    """Batch limits an engine session is tuned for."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    # Token counts of the piecewise CUDA graphs for steps with prompt tokens (chunked mode's
    # mixed batches; engine/piecewise_graphs.py): a step of up to the largest runs padded to
    # the next one, its attention eager between the graphs. Empty: such steps run eagerly.
    # A GPU server in chunked mode gets them from serve.sizing=auto (serving/device_sizing.py).
    piecewise_graph_tokens: list[int] = field(default_factory=list)
    # Each step that carries decode rows is launched before the last one's tokens reach the
    # host, which feeds them to the new step on the device, so that the host's work between
    # steps runs while the GPU steps (engine/step_in_flight.py). Read as `decode.overlap_steps`
    # by the spatial modes' decode worker (spatial/overlapped_decode.py) and by chunked mode's
    # engine (engine/steps_ahead.py), on one GPU; a row that ends is stepped once more, its
    # token dropped.
    overlap_steps: bool = False
    # With overlap_steps, the decode worker launches a step shortly before the one in flight is
    # due to end instead of right after launching it, so that a new split or a joining row
    # reaches the next step rather than the one after (spatial/overlapped_decode.py).
    overlap_launch_late: bool = False


@dataclass
class KVCacheConfig:
    block_size: int = 16
    # 0 means: size the pool from memory (gpu_memory_fraction on GPU, cpu_pool_mib on CPU).
    # On GPU the pool fills the device up to gpu_memory_fraction of its memory, counting all
    # that is in use when it is sized (weights, other processes); the rest is the headroom of
    # the workers, which start later (their contexts, decode graphs and prefill activations:
    # ~14 GiB for an 8B model with 1024 decode slots on an H200).
    num_blocks: int = 0
    gpu_memory_fraction: float = 0.85
    cpu_pool_mib: int = 256
    # Keep the full KV blocks of computed prompts after their request ends, and give them to a
    # later prompt that starts with the same tokens (a shared system prompt, a conversation's
    # earlier turns) instead of computing them again (engine/prefix_cache.py). Off until
    # measured on a GPU; not yet under tensor parallelism.
    prefix_caching: bool = False
    # auto: K and V cached in the model's dtype. fp8: as float8_e4m3fn at a scale of 1 (what
    # vLLM's kv_cache_dtype=fp8 does without scales from the checkpoint; K/V outside +-448
    # saturate), half the bytes: twice the tokens in the pool. Not faster on an H200: decode's
    # attention over FP8 is bound by its loop, not by the bytes (docs/serving.md, "FP8 KV
    # cache"). Needs an FP8-capable GPU (compute 8.9+).
    cache_dtype: str = "auto"


@dataclass
class ServeConfig:
    """How the Triton model schedules work; the SLOs feed the Bullet policy."""

    # auto: bullet on a GPU whose MPS daemon answers (its workers must be MPS clients to run
    # side by side), chunked elsewhere (bullet_trt/serving/modes.py)
    mode: str = "auto"  # auto | chunked | bullet | static
    chunk_size: int = 512
    # auto: on a GPU the server sizes decode slots, their CUDA graphs and the chunk from the
    # device's memory and the performance model, for each of those keys not given as an
    # override (bullet_trt/serving/device_sizing.py); engine: engine.yaml's values as they are.
    sizing: str = "auto"
    # auto: on a GPU with no calibration of the performance model for it in the engine
    # directory, the server measures the GPU once before it loads the model and stores the
    # result there (bullet_trt/serving/calibrate_on_start.py); off: uncalibrated defaults.
    calibrate: str = "auto"
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 50.0
    partitioner: str = "auto"  # auto | green | libsmctrl | mps | none
    libsmctrl_path: str = ""  # the user's libsmctrl.so (never shipped with the project)
    static_prefill_sms: int = 0
    # Neither phase gets fewer SMs than this while both run: cuBLAS matrix-vector products
    # failed on 12- and 4-SM partitions of an H200 and on 8-SM ones of an H100, and ran on 16
    # (docs/gpu-evidence.md), so 16 is also the least it may be set to. 16 rather than
    # more because a handful of decoding sequences (long prompts, short outputs) then leave
    # prefill up to 112 of 132 SMs, which raised the rate bullet sustains there from 11 to 14
    # req/s (docs/benchmarks.md).
    min_phase_sms: int = SMALLEST_PHASE_SMS
    # bullet: whether waiting prompts may be prefilled inside decode's step instead of on a
    # partition beside it. auto: while decode's dense layers are bound by math (a large
    # decode batch), or, on the whole GPU, where the performance model says fused steps do
    # the split's work sooner and keep the queue within TTFT (an MoE decode of few rows), as
    # many whole prompts as keep the step within the TPOT target and chunk_size tokens;
    # always: whatever fits chunk_size, whatever the step's time; never. Prompts may ride
    # while the partition holds a prefill.
    # Fused steps run eagerly in the decode worker unless decode.piecewise_graph_tokens names
    # buckets for them. Off by default: auto measured worse than the partition alone, when a
    # fused prefill still waited for the partition's; with its comparison with the split it
    # fused under 1% of the MoE's prompt tokens under load and moved no edge, its fused steps
    # costing 12-17 ms over a decode step of the same rows (docs/benchmarks.md).
    fuse_prefill: str = "never"
    # bullet, with fuse_prefill: the first prompt that does not fit a fused step whole rides in
    # part, filling the step's chunk_size tokens as chunked's steps do, its rest prefilled in
    # later steps or on the partition; off: fused steps carry whole prompts only. Served on
    # the MoE it moved no edge (docs/benchmarks.md).
    fuse_prompt_slices: bool = False
    # bullet: while decode runs, a prompt may wait up to this fraction of the TTFT SLO for
    # others to join its prefill batch, until the waiting prompts hold prefill_batch_tokens.
    # A separate prefill streams the weights once per batch and slows decode while it runs;
    # fuller, rarer batches do both less often. 0 prefills at once.
    prefill_hold_fraction: float = 0.2
    prefill_batch_tokens: int = 1024
    # bullet / static: true makes a prefill start only once the decode worker has moved to
    # the complementary partition (it switches between steps), so the two never share SMs;
    # the price is up to one decode step's wait before each prefill, and on an H100 that wait
    # cost more sustained rate than the shared SMs did (docs/benchmarks.md, "split
    # handshake"). false: the prefill starts at once, beside a decode step that may still
    # hold the whole GPU.
    prefill_waits_for_split: bool = False
    # bullet: while prompts wait for a prefill not yet started (gathering for a batch, see
    # prefill_hold_fraction, or admitted as a prefill ends, to launch at the next turn), decode
    # moves at once to the complement of the split they are expected to get, so that the
    # prefill starts on SMs decode has already left instead of beside decode's steps on the
    # whole GPU, without the wait of prefill_waits_for_split; decode's steps meanwhile run on
    # fewer SMs. A gathering batch moves decode only once it is expected to start within
    # split_ahead_lead_steps of decode's steps: parked on the complement for whole holds,
    # decode lost more than the shared SMs cost (docs/benchmarks.md, fifteenth round).
    split_ahead: bool = False
    split_ahead_lead_steps: float = 2.0
    # bullet: the SM split is planned so that the waiting prompts are prefilled within this
    # fraction of the TTFT SLO (the rest absorbs arrivals and prediction error).
    ttft_plan_fraction: float = 0.5
    # bullet: decode's step beside a prefill is planned to take at most this fraction
    # of the TPOT SLO. TPOT is each request's mean over its steps, most of which run shorter
    # than the bound, so it is conservative: at 1.02 an H200 sustained 48 ShareGPT-like
    # req/s within a 50 ms TPOT (TPOT p99 40-45 ms) against 46 at 0.85 (docs/benchmarks.md).
    # On an H100 under the three-seed protocol, 1.5 sustained 42 req/s at TPOT <= 40 ms
    # against 36 at 0.85, and 1.0 sustained 40 at TPOT <= 50 ms against 38.
    # 0.85 stays the default: where nearly every step runs beside a prefill (long prompts,
    # short outputs) the mean approaches the bound, that case and the H200 were not measured
    # above 0.85 under the protocol (the H200 at 1.5 fails 50 req/s at TPOT <= 40 ms, lower rates
    # not run), and the H100's runs at 1.5 that ran out of GPU memory have not been repeated since
    # the decode worker's growth was fixed (docs/benchmarks.md, seventh round of 2026-11-26).
    tpot_plan_fraction: float = 0.85
    # bullet: the plan above moves toward the SLO under more pressure: up when the 90th
    # percentile of recent TTFTs (or the oldest waiting prompt's age) is a larger share of the
    # TTFT SLO than recent TPOTs' is of theirs, down the other way (spatial/plan_tuner.py),
    # starting from tpot_plan_fraction, within [0.7, 2]. Off: its first version, on TPOT alone,
    # starved prefill on GPUs (docs/benchmarks.md, seventh round); this one lost too (eleventh).
    tpot_plan_auto: bool = False
    # bullet: decode's step beside a prefill is also kept within what the decoding rows' TPOT
    # can still afford (bullet_trt/spatial/row_pace.py): a row's mean over its gaps, counting
    # the steps it will run after the prefill at the recent mean gap, its length from its
    # max_tokens. A long row then affords steps past the plan's bound, a row of few tokens
    # little (one long step decides it), so with it tpot_plan_fraction is a ceiling that may
    # sit above 1. Off by default until measured on a GPU.
    row_tpot_budget: bool = False
    # bullet: blocks are granted to a decoding row this many tokens before it needs them.
    # The decode worker steps ahead of the orchestrator that grants them; a row whose next
    # block has not come sits out steps (the iteration log's rows_without_block counts them).
    grant_lookahead_tokens: int = 4
    iteration_log: str = ""  # JSONL path of one record a step (chunked: engine/step_log.py); empty: none
    # Overload shedding: a request that finds this many requests, or this many prompt tokens,
    # waiting in the engine (admitted, not yet scheduled) is refused at once with a retryable
    # error instead of queueing for longer than any client waits. A prompt longer than
    # max_queue_tokens is still taken into an empty queue. max_queue_tokens 0: no token bound.
    max_queue: int = 1024
    max_queue_tokens: int = 262144


@dataclass
class ParallelConfig:
    """How many GPUs serve one model (docs/scale-out.md)."""

    # Megatron-style tensor parallelism: every rank holds 1/N of each layer's heads, MLP
    # columns (or experts) and vocabulary, and of the KV pool's heads; the ranks are one
    # process each on cuda:0..N-1 (gloo on CPU), the engine process being rank 0.
    tensor_parallel_size: int = 1
    # Under tensor parallelism, decode steps replay CUDA graphs with the NCCL collectives captured
    # inside (as on one GPU), instead of running eager: eager, a TP=2 decode step of the 8B took
    # 9x its graphed one on two H200s (docs/scale-out.md). False runs TP decode eager; one GPU's
    # decode graphs do not depend on it.
    decode_graphs: bool = True


@dataclass
class EngineConfig:
    engine_dir: str = ""
    checkpoint: str = ""
    tokenizer: str = ""
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    untrained: bool = False
    dummy_weights: bool = False  # random weights made on the device; the checkpoint holds only config.json
    # "fp8": a mixture-of-experts model's experts held as FP8 blocks (one float32 scale per 128 x 128
    # block), quantized as they load, or kept as an FP8 checkpoint stores them; the rest in `dtype`.
    # "fp8-w8a8": fp8, and the experts' inputs rounded to FP8 per token and 128 columns as each
    # step runs, so that both operands of their products are FP8 (the tensor cores' FP8 rate).
    # "auto": for an FP8 checkpoint of a mixture-of-experts model the scheme it names (fp8-w8a8
    # where its activation_scheme is "dynamic", else fp8), else none; "none": every
    # weight in `dtype` (an FP8 checkpoint's dequantized as it loads). docs/moe.md, "FP8 experts"
    quantization: str = "auto"
    description: str = ""
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    prefill: ProfileConfig = field(default_factory=lambda: ProfileConfig(
        max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=2048))
    decode: ProfileConfig = field(default_factory=lambda: ProfileConfig(
        max_num_seqs=64, max_num_batched_tokens=64, max_model_len=2048,
        cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64]))
    serve: ServeConfig = field(default_factory=ServeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # dotted keys set by overrides (--set, Triton model parameters): what the user chose for
    # this run, which device sizing leaves alone; never written to engine.yaml
    overridden: list[str] = field(default_factory=list)

    @property
    def max_model_len(self) -> int:
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    @property
    def max_prompt_len(self) -> int:
        """A prompt must leave room for at least one generated token."""
        return self.max_model_len - 1

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_path(self, value: str) -> Path:
        path = Path(value)
        return path if path.is_absolute() else Path(self.engine_dir) / path

    @property
    def checkpoint_path(self) -> Path:
        return self.resolve_path(self.checkpoint)

    @property
    def tokenizer_path(self) -> Path:
        return self.resolve_path(self.tokenizer or self.checkpoint)

    def validate(self) -> "EngineConfig":
        for name in ("prefill", "decode"):
            p: ProfileConfig = getattr(self, name)
            for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
                if getattr(p, key) <= 0:
                    raise ConfigError(f"{name}.{key} must be > 0, got {getattr(p, key)}")
            if any(int(t) <= 0 for t in p.piecewise_graph_tokens):
                raise ConfigError(f"{name}.piecewise_graph_tokens must hold token counts > 0, "
                                  f"got {p.piecewise_graph_tokens}")
        if self.kv.block_size <= 0:
            raise ConfigError(f"kv.block_size must be > 0, got {self.kv.block_size}")
        if self.kv.num_blocks < 0:
            raise ConfigError(f"kv.num_blocks must be >= 0, got {self.kv.num_blocks}")
        if self.kv.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv.cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv.cache_dtype!r}")
        if not 0 < self.kv.gpu_memory_fraction <= 1:
            raise ConfigError(f"kv.gpu_memory_fraction must be in (0, 1], got {self.kv.gpu_memory_fraction}")
        s = self.serve
        if s.mode not in ("auto", "chunked", "bullet", "static"):
            raise ConfigError(f"serve.mode must be auto, chunked, bullet or static, got {s.mode!r}")
        if s.sizing not in ("auto", "engine"):
            raise ConfigError(f"serve.sizing must be auto or engine, got {s.sizing!r}")
        if s.calibrate not in ("auto", "off"):
            raise ConfigError(f"serve.calibrate must be auto or off, got {s.calibrate!r}")
        if s.ttft_slo_ms <= 0 or s.tpot_slo_ms <= 0:
            raise ConfigError("serve.ttft_slo_ms and serve.tpot_slo_ms must be > 0, got "
                              f"{s.ttft_slo_ms} and {s.tpot_slo_ms}")
        if s.mode == "static" and s.static_prefill_sms <= 0:
            raise ConfigError("serve.static_prefill_sms must be > 0 in static mode (the prefill "
                              f"worker's SM count), got {s.static_prefill_sms}")
        if s.partitioner not in ("auto", "green", "libsmctrl", "mps", "none"):
            raise ConfigError("serve.partitioner must be auto, green, libsmctrl, mps or none, "
                              f"got {s.partitioner!r}")
        if s.fuse_prefill not in ("never", "auto", "always"):
            raise ConfigError(f"serve.fuse_prefill must be never, auto or always, got {s.fuse_prefill!r}")
        if s.min_phase_sms < SMALLEST_PHASE_SMS:
            raise ConfigError(f"serve.min_phase_sms must be >= {SMALLEST_PHASE_SMS} (cuBLAS's one-row products "
                              f"fail on smaller partitions), got {s.min_phase_sms}")
        if not 0 <= s.prefill_hold_fraction < 1:
            raise ConfigError(f"serve.prefill_hold_fraction must be in [0, 1), got {s.prefill_hold_fraction}")
        if not 0 < s.ttft_plan_fraction <= 1:
            raise ConfigError(f"serve.ttft_plan_fraction must be in (0, 1], got {s.ttft_plan_fraction}")
        if s.grant_lookahead_tokens < 0:
            raise ConfigError(f"serve.grant_lookahead_tokens must be >= 0, got {s.grant_lookahead_tokens}")
        if not 0 < s.tpot_plan_fraction <= 2:
            raise ConfigError(f"serve.tpot_plan_fraction must be in (0, 2], got {s.tpot_plan_fraction}")
        if s.split_ahead_lead_steps < 0:
            raise ConfigError(f"serve.split_ahead_lead_steps must be >= 0, got {s.split_ahead_lead_steps}")
        if s.prefill_batch_tokens < 0:
            raise ConfigError(f"serve.prefill_batch_tokens must be >= 0, got {s.prefill_batch_tokens}")
        if s.chunk_size <= 0:
            raise ConfigError(f"serve.chunk_size must be > 0, got {s.chunk_size}")
        if s.max_queue < 1:
            raise ConfigError(f"serve.max_queue must be >= 1, got {s.max_queue}")
        if s.max_queue_tokens < 0:
            raise ConfigError(f"serve.max_queue_tokens must be >= 0 (0: no bound), got {s.max_queue_tokens}")
        if self.kv.prefix_caching and self.parallel.tensor_parallel_size > 1:
            raise ConfigError("kv.prefix_caching is not yet built for tensor parallelism "
                              f"(parallel.tensor_parallel_size={self.parallel.tensor_parallel_size}): "
                              "the other ranks count their free blocks without the cache")
        if self.parallel.tensor_parallel_size < 1:
            raise ConfigError("parallel.tensor_parallel_size must be >= 1, got "
                              f"{self.parallel.tensor_parallel_size}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        return self


def _build(cls, data: dict[str, Any], where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (data or {}).items():
        if key not in known:
            raise ConfigError(f"unknown configuration key {where}{key!r}; known: {sorted(known)}")
        f = known[key]
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if sub is not None and dataclasses.is_dataclass(sub()):
            value = _build(type(sub()), value, f"{where}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def _coerce(text: str, current: Any) -> Any:
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, list):
        return yaml.safe_load(text)
    return text


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """``["serve.mode=chunked", ...]`` (the CLI's ``--set``) as a dict of dotted keys."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value (e.g. serve.mode=chunked), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def apply_overrides(cfg: EngineConfig, overrides: dict[str, Any] | None) -> EngineConfig:
    """Sets dotted keys (``serve.mode``); string values are coerced to the field's type."""
    for dotted, value in (overrides or {}).items():
        target: Any = cfg
        *path, last = dotted.split(".")
        for part in path:
            if not hasattr(target, part):
                raise ConfigError(f"unknown configuration key {dotted!r}")
            target = getattr(target, part)
        if not hasattr(target, last) or dataclasses.is_dataclass(getattr(target, last)):
            raise ConfigError(f"unknown configuration key {dotted!r}")
        current = getattr(target, last)
        try:
            setattr(target, last, _coerce(value, current) if isinstance(value, str) else value)
        except ValueError as e:  # a value of the wrong kind: name the key, not only the text
            raise ConfigError(f"{dotted}: {e}") from None
        if dotted not in cfg.overridden:
            cfg.overridden.append(dotted)
    return cfg


def load_engine_config(engine_dir: str | Path, overrides: dict[str, Any] | None = None) -> EngineConfig:
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: build an engine directory with build_engines.py")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    cfg = _build(EngineConfig, data, "")
    cfg.engine_dir = str(engine_dir.resolve())
    return apply_overrides(cfg, overrides).validate()


def save_engine_config(cfg: EngineConfig, engine_dir: str | Path, header: str = "") -> Path:
    data = dataclasses.asdict(cfg)
    data.pop("engine_dir")
    data.pop("overridden")
    path = Path(engine_dir) / ENGINE_FILE
    with open(path, "w") as f:
        if header:
            f.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(data, f, sort_keys=False)
    return path
