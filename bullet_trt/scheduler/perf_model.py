"""Performance model: predicted prefill and decode-step latency on a share of the SMs.

An SM-scaling roofline. A step moves B bytes and does F floating-point operations; on s SMs
it takes max(F / compute(s), B / bandwidth(s)) plus a fixed launch overhead, where

    compute(s)   = peak_tflops * s / total_sms              (GEMM rate scales with SMs)
    bandwidth(s) = bw_max * s * (total + k) / (total * (s + k))   (saturates: k = bw_knee_sms)

so bandwidth(total) = bw_max and half of it needs far fewer than half of the SMs (DESIGN.md
section 2: 64 of 132 SMs already reach ~90% of the copy bandwidth). The byte and FLOP counts
come from the model shape; the five coefficients are fitted to measured points on the target
GPU (``build_engines.py --profile``) and each phase carries an online correction factor that
tracks measured/predicted iteration times while serving, one per SM count it ran on: a
phase's partition runs beside the other phase (sharing memory bandwidth, L2 and the chip's
power budget) and small partitions run some kernels in extra waves, neither of which the
roofline sees. With one factor per phase, which the full-GPU steps dominate, decode steps
beside a prefill ran a median 17% over their prediction on ShareGPT-like load (and 37% at
the 90th percentile on Azure-code-like load); per SM count, 0% (docs/gpu-evidence.md). The
phase-wide factor stands in for SM counts not yet observed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

PERF_MODEL_FILE = "perf_model.yaml"


@dataclass
class ModelCost:
    """Per-token and per-step work of one forward pass, from the architecture."""

    weight_bytes: float  # read once per step
    flops_per_token: float  # dense layers: 2 * parameters touched per token
    kv_bytes_per_token: float  # K and V of one cached token, all layers
    attn_flops_per_pair: float  # QK^T and PV for one (query, key) pair, all layers

    @staticmethod
    def from_arch(arch, dtype_bytes: int) -> "ModelCost":
        h, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
        params = layers * per_layer + arch.vocab_size * h  # lm_head; embedding is a gather
        return ModelCost(weight_bytes=params * dtype_bytes, flops_per_token=2.0 * params,
                         kv_bytes_per_token=2.0 * layers * kv * dtype_bytes,
                         attn_flops_per_pair=4.0 * layers * q)


@dataclass
class RooflineCoeffs:
    total_sms: int
    peak_tflops: float
    bw_max_gbs: float
    bw_knee_sms: float
    prefill_overhead_ms: float
    decode_overhead_ms: float

    def compute(self, sms: int) -> float:
        """FLOP per ms on `sms` SMs."""
        return self.peak_tflops * 1e9 * min(sms, self.total_sms) / self.total_sms

    def bandwidth(self, sms: int) -> float:
        """Bytes per ms on `sms` SMs."""
        s, t, k = min(sms, self.total_sms), self.total_sms, self.bw_knee_sms
        return self.bw_max_gbs * 1e6 * s * (t + k) / (t * (s + k))


@dataclass
class PrefillShape:
    num_tokens: int  # new tokens in the batch
    attn_pairs: float  # sum over sequences of q_len * (cached + (q_len + 1) / 2)

    @staticmethod
    def of(q_lens: list[int], cached: list[int] | None = None) -> "PrefillShape":
        cached = cached or [0] * len(q_lens)
        return PrefillShape(sum(q_lens), float(sum(q * (c + (q + 1) / 2) for q, c in zip(q_lens, cached))))


class PerfModel:
    def __init__(self, cost: ModelCost, coeffs: RooflineCoeffs, ewma: float = 0.2):
        self.cost = cost
        self.coeffs = coeffs
        # fused: a decode step that also prefills whole prompts (one pass over the weights)
        self.correction = {"prefill": 1.0, "decode": 1.0, "fused": 1.0}
        self.split_correction: dict[tuple[str, int], float] = {}
        self.ewma = ewma

    def factor(self, phase: str, sms: int) -> float:
        return self.split_correction.get((phase, sms), self.correction[phase])

    # -- raw roofline ------------------------------------------------------------------------
    def _prefill_raw(self, shape: PrefillShape, sms: int) -> float:
        c, k = self.cost, self.coeffs
        flops = c.flops_per_token * shape.num_tokens + c.attn_flops_per_pair * shape.attn_pairs
        moved = c.weight_bytes + c.kv_bytes_per_token * shape.num_tokens
        return max(flops / k.compute(sms), moved / k.bandwidth(sms)) + k.prefill_overhead_ms

    def _decode_raw(self, batch: int, total_ctx: int, sms: int, prompts: PrefillShape | None = None) -> float:
        c, k = self.cost, self.coeffs
        flops = c.flops_per_token * batch + c.attn_flops_per_pair * total_ctx
        moved = c.weight_bytes + c.kv_bytes_per_token * total_ctx
        if prompts is not None:
            flops += c.flops_per_token * prompts.num_tokens + c.attn_flops_per_pair * prompts.attn_pairs
            moved += c.kv_bytes_per_token * prompts.num_tokens
        return max(flops / k.compute(sms), moved / k.bandwidth(sms)) + k.decode_overhead_ms

    def decode_gemms_compute_bound(self, batch: int, sms: int) -> bool:
        """Whether a decode step of `batch` rows on `sms` SMs is limited by math rather than
        by streaming the weights, in its dense layers (its attention streams the KV cache
        either way). Past that point a prefill on a partition beside it takes SMs from a
        phase that needs them, while a prefill inside the step shares its weight stream."""
        c, k = self.cost, self.coeffs
        return c.flops_per_token * batch / k.compute(sms) >= c.weight_bytes / k.bandwidth(sms)

    # -- corrected predictions ---------------------------------------------------------------
    def prefill_ms(self, shape: PrefillShape, sms: int) -> float:
        return self._prefill_raw(shape, sms) * self.factor("prefill", sms)

    def decode_ms(self, batch: int, total_ctx: int, sms: int) -> float:
        return self._decode_raw(batch, total_ctx, sms) * self.factor("decode", sms)

    def fused_ms(self, batch: int, total_ctx: int, prompts: PrefillShape, sms: int) -> float:
        """A decode step that also prefills `prompts`."""
        return self._decode_raw(batch, total_ctx, sms, prompts) * self.factor("fused", sms)

    def observe(self, phase: str, predicted_ms: float, measured_ms: float, sms: int | None = None) -> None:
        """Moves the phase's corrections toward measured/roofline: the phase-wide one and, given
        the SM count it ran on, that count's (which starts from the phase-wide one).
        `predicted_ms` is this model's prediction for the run, correction included."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        used = self.correction[phase] if sms is None else self.factor(phase, sms)
        ratio = measured_ms / (predicted_ms / used)
        ratio = min(max(ratio, 0.1), 10.0)  # one outlier (a page fault, a GC) must not swing it
        if sms is not None:
            key = (phase, sms)
            current = self.split_correction.get(key, self.correction[phase])
            self.split_correction[key] = current + self.ewma * (ratio - current)
        self.correction[phase] += self.ewma * (ratio - self.correction[phase])

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        data = {"coeffs": asdict(self.coeffs), **(extra or {})}
        Path(path).write_text(yaml.safe_dump(data, sort_keys=False))

    @staticmethod
    def load(path: str | Path, cost: ModelCost) -> "PerfModel":
        data = yaml.safe_load(Path(path).read_text())
        return PerfModel(cost, RooflineCoeffs(**data["coeffs"]))

    @staticmethod
    def default(cost: ModelCost, total_sms: int, on_gpu: bool) -> "PerfModel":
        """Uncalibrated guesses: an H100/H200-class GPU, or a slow CPU. Calibrate for real use."""
        if on_gpu:
            return PerfModel(cost, RooflineCoeffs(total_sms, 600.0, 3500.0, 30.0, 0.5, 0.3))
        return PerfModel(cost, RooflineCoeffs(max(total_sms, 1), 0.05, 10.0, 1.0, 2.0, 2.0))


# -- calibration ---------------------------------------------------------------------------
@dataclass
class ProfilePoint:
    phase: str  # prefill | decode
    sms: int
    measured_ms: float
    num_tokens: int = 0  # prefill
    attn_pairs: float = 0.0  # prefill
    batch: int = 0  # decode
    total_ctx: int = 0  # decode


def predict_point(model: PerfModel, p: ProfilePoint) -> float:
    if p.phase == "prefill":
        return model.prefill_ms(PrefillShape(p.num_tokens, p.attn_pairs), p.sms)
    return model.decode_ms(p.batch, p.total_ctx, p.sms)


def fit(cost: ModelCost, total_sms: int, points: list[ProfilePoint], steps: int = 3000) -> PerfModel:
    """Least squares on log(predicted / measured) over the five coefficients (kept positive
    through a log parametrisation); the max() of the roofline is smoothed during the fit so
    gradients reach both terms."""
    import torch

    start = PerfModel.default(cost, total_sms, on_gpu=total_sms > 1).coeffs
    names = ["peak_tflops", "bw_max_gbs", "bw_knee_sms", "prefill_overhead_ms", "decode_overhead_ms"]
    logs = torch.tensor([math.log(max(getattr(start, n), 1e-6)) for n in names], dtype=torch.float64,
                        requires_grad=True)
    phase = torch.tensor([p.phase == "prefill" for p in points])
    sms = torch.tensor([float(min(p.sms, total_sms)) for p in points], dtype=torch.float64)
    tokens = torch.tensor([float(p.num_tokens if p.phase == "prefill" else p.batch) for p in points],
                          dtype=torch.float64)
    pairs = torch.tensor([p.attn_pairs if p.phase == "prefill" else float(p.total_ctx) for p in points],
                         dtype=torch.float64)
    kv_tokens = torch.tensor([float(p.num_tokens if p.phase == "prefill" else p.total_ctx) for p in points],
                             dtype=torch.float64)
    measured = torch.tensor([p.measured_ms for p in points], dtype=torch.float64)
    flops = cost.flops_per_token * tokens + cost.attn_flops_per_pair * pairs
    moved = cost.weight_bytes + cost.kv_bytes_per_token * kv_tokens
    t = float(total_sms)

    def predict(lg):
        peak, bw, knee, o_pre, o_dec = lg.exp()
        compute_ms = flops / (peak * 1e9 * sms / t)
        memory_ms = moved / (bw * 1e6 * sms * (t + knee) / (t * (sms + knee)))
        return compute_ms, memory_ms, torch.where(phase, o_pre, o_dec)

    opt = torch.optim.Adam([logs], lr=0.05)
    for i in range(steps):
        sharp = 4.0 + 60.0 * i / steps  # smooth max -> hard max as the fit settles
        c, m, o = predict(logs)
        pred = torch.logsumexp(torch.stack([c, m]) * sharp / measured, dim=0) * measured / sharp + o
        loss = ((pred.log() - measured.log()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    values = dict(zip(names, logs.detach().exp().tolist()))
    return PerfModel(cost, RooflineCoeffs(total_sms=total_sms, **values))


def median_abs_pct_error(model: PerfModel, points: list[ProfilePoint]) -> float:
    errs = sorted(abs(predict_point(model, p) - p.measured_ms) / p.measured_ms for p in points)
    n = len(errs)
    return 100.0 * (errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2)
