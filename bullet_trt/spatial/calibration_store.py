"""Which calibration of the performance model fits the GPU the engine runs on.

A calibration holds for the GPU it was measured on: an H100 and an H200 have the same 132
SMs but different memory bandwidth, and the two rank bullet's and chunked's rates
differently (docs/benchmarks.md). An engine directory therefore keeps one calibration per
GPU model, ``perf_model.<gpu>.yaml`` (``perf_model.nvidia-h100-80gb-hbm3.yaml``), and the
server takes the one of the GPU it runs on. A plain ``perf_model.yaml`` is still read: as
it is when it names no GPU (written by hand), and only on its own GPU when it names one.

A calibration also holds only for the kernels it timed: a mixture-of-experts model's steps
take their expert tiles from a tuned table per GPU (kernels/moe_tiles.py), and a new table
made the H200's MoE decode steps up to 1.25x faster per layer (docs/moe.md). A calibration
records the tiles it ran under, and the digest of the step's code it timed (spatial/step_code.py:
new kernels made that step 1.14x faster under the same tiles); under other tiles or other code it
is stale: ``serve.calibrate=auto`` measures again at start, and where nothing measures, it is
still used, and the server says so. Quantized experts and an FP8 KV pool run other kernels: their
calibrations are files of their own (``perf_model.<gpu>.fp8-w8a8.kv-fp8.yaml``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bullet_trt.config import EngineConfig
from bullet_trt.kernels import moe_tiles
from bullet_trt.model.arch import ModelArch
from bullet_trt.spatial.perf_model import PERF_MODEL_FILE, ModelCost, PerfModel
from bullet_trt.spatial.step_code import step_code


def gpu_slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def _suffix(expert_quantization: str, kv_cache_dtype: str) -> str:
    # quantized experts run other kernels at other speeds, and so does attention over an FP8 KV
    # pool: each such calibration is kept beside the bf16 one, so that an engine directory served
    # several ways keeps them all
    experts = "" if expert_quantization == "none" else f".{expert_quantization}"
    return experts + ("" if kv_cache_dtype == "auto" else f".kv-{kv_cache_dtype}")


def calibration_file(engine_dir: str | Path, gpu_name: str, expert_quantization: str = "none",
                     kv_cache_dtype: str = "auto") -> Path:
    """``kv_cache_dtype``: the server's kv.cache_dtype (auto, fp8)."""
    return Path(engine_dir) / f"perf_model.{gpu_slug(gpu_name)}{_suffix(expert_quantization, kv_cache_dtype)}.yaml"


def profile_file(engine_dir: str | Path, gpu_name: str, expert_quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> Path:
    """Every point the calibration measured, next to it."""
    return Path(engine_dir) / f"perf_profile.{gpu_slug(gpu_name)}{_suffix(expert_quantization, kv_cache_dtype)}.json"


def moe_tiles_of(arch: ModelArch, gpu_name: str, expert_quantization: str = "none",
                 model_dtype: object = "bfloat16") -> str | None:
    """The MoE kernels' tiles on this GPU (moe_tiles.fingerprint of the tables their weights'
    dtype takes: ``model_dtype``'s, or FP8's where ``expert_quantization`` names it), and that
    quantization where there is one (fp8, fp8-w8a8: other kernels, so a calibration of the bf16
    experts is stale for them, and the other way round); None for a dense model."""
    if not arch.moe_layers:
        return None
    # model_dtype: a torch.dtype or its name
    weights = str(model_dtype).removeprefix("torch.") if expert_quantization == "none" else "float8_e4m3fn"
    table_dtype = moe_tiles.dtype_label(weights, expert_quantization == "fp8-w8a8")
    tiles = moe_tiles.fingerprint(gpu_name, arch.num_experts, arch.moe_intermediate_size, arch.hidden_size,
                                  arch.num_experts_per_tok, table_dtype)
    return tiles if expert_quantization == "none" else f"{tiles}; experts {expert_quantization}"


@dataclass(frozen=True)
class CalibrationKey:
    """What picks a server's calibration and says whether it still holds: the GPU it runs on
    (its model's name and its SMs), the MoE tiles its kernels run (``moe_tiles_of``; None for a
    dense model), and the experts' quantization and the KV pool's dtype, each pair with a file of
    its own (``calibration_file``). Every place that reads or writes a calibration builds it the
    same way, ``for_server``, so a new part of a server's identity is added once."""
    gpu_name: str
    total_sms: int
    moe_tiles: str | None = None
    expert_quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @classmethod
    def for_server(cls, cfg: EngineConfig, arch: ModelArch, gpu_name: str, total_sms: int,
                   model_dtype: object) -> CalibrationKey:
        """``model_dtype``: the dtype the server loads the weights in (a torch.dtype or its name)."""
        experts = arch.expert_quantization(cfg.quantization)
        return cls(gpu_name, total_sms, moe_tiles_of(arch, gpu_name, experts, model_dtype), experts,
                   cfg.kv.cache_dtype)

    def file(self, engine_dir: str | Path) -> Path:
        return calibration_file(engine_dir, self.gpu_name, self.expert_quantization, self.kv_cache_dtype)

    def profile(self, engine_dir: str | Path) -> Path:
        return profile_file(engine_dir, self.gpu_name, self.expert_quantization, self.kv_cache_dtype)


@dataclass(frozen=True)
class Calibration:
    path: Path | None  # None: no calibration fits; the uncalibrated defaults stand in
    note: str  # what was chosen and why, for the server's log
    stale: str = ""  # why the chosen one no longer describes the kernels this server runs
    data: dict = field(default_factory=dict)  # the chosen file's contents, read once


def _read(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _stale(path: Path, data: dict, moe_tiles: str | None) -> str:
    """Why the calibration at ``path`` (its contents ``data``) timed other code than this
    server's step (``step_code``) or other MoE tiles than ``moe_tiles``, or ""."""
    report = data.get("calibration") or {}  # none: written by hand, not timed
    why = []
    timed_code = report.get("step_code")
    if report and timed_code != step_code():
        timed = f"step code {timed_code}" if timed_code else "a step from before calibrations recorded its code"
        why.append(f"{path.name} timed {timed}, this server runs step code {step_code()}")
    # calibrations from before the tuned tables ran the untuned ones
    measured = report.get("moe_tiles", "untuned")
    if moe_tiles is not None and measured != moe_tiles:
        why.append(f"{path.name} timed the MoE kernels' tiles {measured}, this server runs {moe_tiles}")
    return "; ".join(why)


def find_calibration(engine_dir: str | Path, key: CalibrationKey) -> Calibration:
    """The server's own file (``key.file``), else a plain one measured on its GPU and SMs or
    naming none; stale where it timed other MoE tiles than ``key.moe_tiles`` or other step code."""
    gpu_name, total_sms, moe_tiles = key.gpu_name, key.total_sms, key.moe_tiles
    own = key.file(engine_dir)
    if own.is_file():
        data = _read(own)
        return Calibration(own, f"calibrated on {gpu_name} ({own.name})", _stale(own, data, moe_tiles), data)
    plain = Path(engine_dir) / PERF_MODEL_FILE
    if not plain.is_file():
        return Calibration(None, f"no calibration for {gpu_name}")
    data = _read(plain)
    measured_on = (data.get("calibration") or {}).get("gpu")
    measured_sms = (data.get("coeffs") or {}).get("total_sms")
    if measured_on is not None and measured_on != gpu_name:
        return Calibration(None, f"no calibration for {gpu_name} ({plain.name} was measured on {measured_on})")
    if measured_sms is not None and measured_sms != total_sms:
        # the same GPU model cut into a MIG slice, or a green context the server was started in
        return Calibration(None, f"no calibration for {total_sms} SMs ({plain.name} was measured on {measured_sms})")
    return Calibration(plain, f"calibration {plain.name}" + (f" ({measured_on})" if measured_on else ""),
                       _stale(plain, data, moe_tiles), data)


def measured_prefill_graphs(data: dict) -> list[int]:
    """The token buckets of the piecewise graphs a saved calibration's prefill steps replayed
    ([]: eager, as every calibration made before it recorded them was)."""
    return list((data.get("calibration") or {}).get("prefill_graph_tokens") or [])


def _how(graph_tokens: list[int]) -> str:
    # the whole list: two sets of buckets that both end at the chunk pad batches differently
    return f"through graphs of {graph_tokens} tokens" if graph_tokens else "eagerly"


def load_perf_model(engine_dir: str | Path, cost: ModelCost, key: CalibrationKey | None,
                    prefill_graph_tokens: list[int] | None = None, cpu_sms: int = 1) -> tuple[PerfModel, str]:
    """The performance model for this device (``key`` None: the CPU, of ``cpu_sms`` workers'
    share) and a line saying where it came from. Without a fitting calibration
    (``find_calibration``), uncalibrated defaults that the online correction then pulls toward
    measured times. `prefill_graph_tokens`: the prefill worker's
    graph buckets, where a prefill worker runs; a calibration measured otherwise is still
    taken, but the line says so: an eager prefill can be bound by the host launching kernels
    (a mixture-of-experts model's 128-token prefill on an H200: 42 ms eager, 15 ms graphed,
    docs/moe.md), a graphed one need not."""
    if key is None:
        return PerfModel.default(cost, cpu_sms, on_gpu=False), "CPU: uncalibrated defaults"
    found = find_calibration(engine_dir, key)
    if found.path is None:
        return PerfModel.default(cost, key.total_sms, on_gpu=True), f"{found.note}: uncalibrated defaults"
    note, data = found.note, found.data
    measured = measured_prefill_graphs(data)
    if prefill_graph_tokens is not None and measured != list(prefill_graph_tokens):
        note += (f"; its prefill steps ran {_how(measured)}, this server's prefill worker runs them "
                 f"{_how(list(prefill_graph_tokens))}, so its prefill figures are off until the online "
                 f"correction has caught up (delete {found.path.name} to measure again at start)")
    if found.stale:
        note += (f"; stale: {found.stale}, so its figures are off until the online correction has caught "
                 f"up (serve.calibrate=auto measures again at start)")
    return PerfModel.from_saved(data, cost), note
