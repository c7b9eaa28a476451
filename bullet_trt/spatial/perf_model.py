"""Performance model: predicted prefill and decode-step latency on a share of the SMs.

An SM-scaling roofline per kernel class. A step runs its dense layers (GEMMs over every token
of the batch, one pass over the weights) and its attention (over each sequence's cached and
new tokens) one after the other, so each part has its own bound and the step takes their sum:

    step(s) = max(F_dense / compute(s), B_weights / bandwidth(s))
            + max(F_attn / compute(s), B_kv / bandwidth(s)) + overhead

    compute(s)   = peak_tflops * s / total_sms              (GEMM rate scales with SMs)
    bandwidth(s) = bw_max * s * (total + k) / (total * (s + k))   (saturates: k = bw_knee_sms)

so bandwidth(total) = bw_max and half of it needs far fewer than half of the SMs (docs/gpu-facts.md,
fact 5: 64 of 132 SMs already reach ~90% of the copy bandwidth). A mixture-of-experts model's
B_weights grows with the step's tokens, as they reach more of the experts
(``ModelCost.step_weight_bytes``). A single max over the
whole step's work (the first version of this model) is right while both parts are bound by
the same resource, but a large decode batch has compute-bound GEMMs beside memory-bound
attention, and their times add: a step of 1024 rows of 512-token contexts on an H200 took
39.7 ms, the single max fitted to the same calibration said 29.5 ms and the sum 39.8 ms
(docs/gpu-evidence.md, seventh round). The byte and FLOP counts come from the model shape; the
coefficients are fitted to steps measured on the target GPU (``build_engines.py
--profile``), up to the decode profile's largest batch.

Two terms the roofline lacks, both fitted and both absent (zero) in calibrations made before
them, which therefore predict as they did:

- floors: a step takes at least ``prefill_floor_ms`` / ``decode_floor_ms`` whatever its
  work, the host issuing an eager step's kernels or a graph's chain of small kernels; the
  GPU's work hides under it (step = max(floor, roofline)). A Qwen3-30B-A3B eager prefill on
  an H200 took ~80 ms from 128 to 2048 tokens in a calibration that ran it eagerly on prompts
  of one repeated token, which no roofline plus a constant can hold.
- a mixture-of-experts model's routed experts: their grouped GEMMs run at ``expert_tflops``
  and after their weight stream rather than under it (experts = FLOPs / rate + bytes /
  bandwidth), beside the dense layers' max. On the same H200's points the two terms took the
  held-out median error from 33.5% to 7.7% (docs/benchmarks.md, "Qwen3-30B-A3B on one H200");
  the calibration now served, prefill through graphs on random prompts, fits within 5.7%.

Each phase also carries an online correction that tracks measured/predicted step times
while serving, one per SM count it ran on: a partition runs beside the other phase (sharing
memory bandwidth, L2 and the chip's power budget) and small partitions run some kernels in
extra waves, neither of which the roofline sees. A count's correction holds only while it
is fresh (observed within the last `stale_after` observations); otherwise the nearest count
with a fresh one stands in, and the phase-wide one when there is none. Corrections learned
under other loads must not veto a split forever: an SM count the policy never picks is
never measured, so its old correction would never be replaced (at 60 req/s of
ShareGPT-like load that pinned prefill to 24 SMs while the queue grew to 450 prompts).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

PERF_MODEL_FILE = "perf_model.yaml"


@dataclass
class ModelCost:
    """Per-token and per-step work of one forward pass, from the architecture.

    A mixture-of-experts model reads only the experts its tokens were routed to: a step reads
    the weights outside the experts, plus ``expert_bytes`` for each expert hit per MoE layer
    (``step_weight_bytes``), and a token's FLOPs count only its own ``experts_per_token``."""

    weight_bytes: float  # read once per step (of an MoE model: all but the experts)
    flops_per_token: float  # dense layers: 2 * parameters touched per token
    kv_bytes_per_token: float  # K and V of one cached token, all layers
    attn_flops_per_pair: float  # QK^T and PV for one (query, key) pair, all layers
    expert_bytes: float = 0.0  # one expert of every MoE layer together
    num_experts: int = 0  # per MoE layer
    experts_per_token: int = 0
    expert_flops_per_token: float = 0.0  # the part of flops_per_token in the routed experts

    @staticmethod
    def from_arch(arch, dtype_bytes: int, fp8_experts: bool = False, kv_dtype_bytes: int | None = None) -> "ModelCost":
        """``fp8_experts``: the experts are read at one byte a weight (quantization=fp8);
        ``kv_dtype_bytes``: a cached K or V value's bytes (kv.cache_dtype; None: dtype_bytes)."""
        h, layers = arch.hidden_size, arch.num_layers
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        moe = len(arch.moe_layers)
        attention = h * (q + 2 * kv) + q * h
        dense_mlp = 3 * h * arch.intermediate_size
        expert = 3 * h * arch.moe_intermediate_size
        router = h * arch.num_experts
        lm_head = arch.vocab_size * h  # the embedding is a gather
        read = layers * attention + (layers - moe) * dense_mlp + moe * router + lm_head
        touched = read + moe * arch.num_experts_per_tok * expert
        return ModelCost(weight_bytes=read * dtype_bytes, flops_per_token=2.0 * touched,
                         kv_bytes_per_token=2.0 * layers * kv * (kv_dtype_bytes or dtype_bytes),
                         attn_flops_per_pair=4.0 * layers * q,
                         expert_bytes=moe * expert * (1 if fp8_experts else dtype_bytes),
                         num_experts=arch.num_experts if moe else 0,
                         experts_per_token=arch.num_experts_per_tok if moe else 0,
                         expert_flops_per_token=2.0 * moe * arch.num_experts_per_tok * expert)

    @staticmethod
    def of_state(state) -> "ModelCost":
        """The cost of the model an engine's shared state (engine/shared_state.py) holds: its
        weights' dtype, its experts' form and its pool's element type."""
        return ModelCost.from_arch(state.arch, state.dtype.itemsize, state.fp8_experts, state.kv_pool.element_size())

    def per_rank(self, tp: int, kv_heads_per_rank: int, num_kv_heads: int) -> "ModelCost":
        """One tensor-parallel rank's share: 1/tp of the weights, FLOPs, attention and the
        experts hit (a rank holds 1/tp of the experts), and the KV of the heads it keeps
        (replicated ones included). The all-reduces between the ranks are not counted: the
        online correction absorbs them until a calibration under tensor parallelism exists."""
        if tp == 1:
            return self
        return replace(self, weight_bytes=self.weight_bytes / tp, flops_per_token=self.flops_per_token / tp,
                       kv_bytes_per_token=self.kv_bytes_per_token * kv_heads_per_rank / num_kv_heads,
                       attn_flops_per_pair=self.attn_flops_per_pair / tp, expert_bytes=self.expert_bytes / tp,
                       expert_flops_per_token=self.expert_flops_per_token / tp)

    def experts_hit(self, tokens: float) -> float:
        """Experts of one MoE layer that `tokens` tokens are expected to reach, if each token's
        experts were drawn uniformly: E * (1 - (1 - k/E)^tokens). Real routers favour some
        experts, so this is an upper bound that the calibration's fit absorbs."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens)

    def step_weight_bytes(self, tokens: float) -> float:
        """Weights a step over `tokens` new tokens reads: all of a dense model's; an MoE
        model's outside the experts plus the experts hit."""
        return self.weight_bytes + self.expert_bytes * self.experts_hit(tokens)


@dataclass
class RooflineCoeffs:
    total_sms: int
    peak_tflops: float
    bw_max_gbs: float
    bw_knee_sms: float
    prefill_overhead_ms: float
    decode_overhead_ms: float
    # The least a step takes whatever its work (0: none). An eager step is bound by the host
    # issuing its kernels (a Qwen3-MoE prefill on an H200: 42-60 ms from 128 to 2048 tokens,
    # its kernels 13 ms at 128), a graph replay by its chain of small kernels; the GPU's work
    # hides under it.
    prefill_floor_ms: float = 0.0
    decode_floor_ms: float = 0.0
    # The rate of the routed experts' grouped GEMMs, which run neither at the dense GEMM rate
    # nor overlapped with their own weight stream (0: counted with the dense layers, as
    # calibrations made before this term were)
    expert_tflops: float = 0.0

    def compute(self, sms: int) -> float:
        """FLOP per ms on `sms` SMs."""
        return self.peak_tflops * 1e9 * min(sms, self.total_sms) / self.total_sms

    def expert_compute(self, sms: int) -> float:
        """FLOP per ms of the routed experts' GEMMs on `sms` SMs."""
        return self.expert_tflops * 1e9 * min(sms, self.total_sms) / self.total_sms

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
    def __init__(self, cost: ModelCost, coeffs: RooflineCoeffs, ewma: float = 0.2, stale_after: int = 256):
        self.cost = cost
        self.coeffs = coeffs
        # fused: a decode step that also prefills whole prompts (one pass over the weights)
        self.correction = {"prefill": 1.0, "decode": 1.0, "fused": 1.0}
        self.split_correction: dict[tuple[str, int], float] = {}
        self.last_seen: dict[tuple[str, int], int] = {}  # observation count at the last update
        self.observations = 0
        self.ewma = ewma
        self.stale_after = stale_after

    def _fresh(self, key: tuple[str, int]) -> bool:
        return self.observations - self.last_seen.get(key, -(1 << 62)) <= self.stale_after

    def factor(self, phase: str, sms: int) -> float:
        """The correction for `phase` on `sms` SMs: its own while fresh, else the nearest SM
        count's that is (the larger on a tie), else the phase-wide one."""
        if self._fresh((phase, sms)):  # fresh implies observed: both maps are set together
            return self.split_correction[(phase, sms)]
        fresh = [s for (p, s) in self.split_correction if p == phase and self._fresh((p, s))]
        if not fresh:
            return self.correction[phase]
        nearest = min(fresh, key=lambda s: (abs(s - sms), -s))
        return self.split_correction[(phase, nearest)]

    # -- raw roofline ------------------------------------------------------------------------
    def _step_raw(self, dense_tokens: float, attn_pairs: float, kv_tokens: float, sms: int) -> float:
        """Dense layers over `dense_tokens` plus attention over `attn_pairs` (query, key)
        pairs that reads or writes `kv_tokens` tokens of K/V, overhead excluded."""
        c, k = self.cost, self.coeffs
        compute, bandwidth = k.compute(sms), k.bandwidth(sms)
        attention = max(c.attn_flops_per_pair * attn_pairs / compute, c.kv_bytes_per_token * kv_tokens / bandwidth)
        if not self._experts_apart():
            dense = max(c.flops_per_token * dense_tokens / compute, c.step_weight_bytes(dense_tokens) / bandwidth)
            return dense + attention
        dense = max((c.flops_per_token - c.expert_flops_per_token) * dense_tokens / compute,
                    c.weight_bytes / bandwidth)
        experts = (c.expert_flops_per_token * dense_tokens / k.expert_compute(sms)
                   + (c.step_weight_bytes(dense_tokens) - c.weight_bytes) / bandwidth)
        return dense + experts + attention

    def _experts_apart(self) -> bool:
        return self.cost.expert_flops_per_token > 0 and self.coeffs.expert_tflops > 0

    def _prefill_raw(self, shape: PrefillShape, sms: int) -> float:
        return max(self.coeffs.prefill_floor_ms,
                   self._step_raw(shape.num_tokens, shape.attn_pairs, shape.num_tokens, sms)
                   + self.coeffs.prefill_overhead_ms)

    def _decode_raw(self, batch: int, total_ctx: int, sms: int, prompts: PrefillShape | None = None) -> float:
        tokens, pairs, kv = float(batch), float(total_ctx), float(total_ctx)
        if prompts is not None:
            tokens += prompts.num_tokens
            pairs += prompts.attn_pairs
            kv += prompts.num_tokens
        return max(self.coeffs.decode_floor_ms, self._step_raw(tokens, pairs, kv, sms) + self.coeffs.decode_overhead_ms)

    def decode_gemms_compute_bound(self, batch: int, sms: int) -> bool:
        """Whether a decode step of `batch` rows on `sms` SMs is limited by math rather than
        by streaming the weights, in its dense layers (its attention streams the KV cache
        either way). Past that point a prefill on a partition beside it takes SMs from a
        phase that needs them, while a prefill inside the step shares its weight stream."""
        c, k = self.cost, self.coeffs
        if not self._experts_apart():
            return c.flops_per_token * batch / k.compute(sms) >= c.step_weight_bytes(batch) / k.bandwidth(sms)
        math_ms = ((c.flops_per_token - c.expert_flops_per_token) * batch / k.compute(sms)
                   + c.expert_flops_per_token * batch / k.expert_compute(sms))
        return math_ms >= c.step_weight_bytes(batch) / k.bandwidth(sms)

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
        the SM count it ran on, that count's (which starts from the one its prediction used).
        `predicted_ms` is this model's prediction for the run, correction included."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        used = self.correction[phase] if sms is None else self.factor(phase, sms)
        ratio = measured_ms / (predicted_ms / used)
        ratio = min(max(ratio, 0.1), 10.0)  # one outlier (a page fault, a GC) must not swing it
        self.observations += 1
        if sms is not None:
            key = (phase, sms)
            self.split_correction[key] = used + self.ewma * (ratio - used)
            self.last_seen[key] = self.observations
        self.correction[phase] += self.ewma * (ratio - self.correction[phase])

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Written whole, then renamed into place: servers on other GPUs of the machine may be
        reading the engine directory's calibration while this one measures it again."""
        data = {"coeffs": asdict(self.coeffs), **(extra or {})}
        path = Path(path)
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        part.write_text(yaml.safe_dump(data, sort_keys=False))
        os.replace(part, path)

    @staticmethod
    def from_saved(data: dict, cost: ModelCost) -> "PerfModel":
        """The model of a saved file's contents (`save`)."""
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


# No GPU the project targets multiplies dense bf16 faster (an H200: ~990 TFLOP/s at its peak
# clock). A model whose steps the experts or the weight stream bind leaves the dense rate
# nearly free in the fit, and the bound keeps it from drifting to absurd values.
MAX_PEAK_TFLOPS = 2500.0


def fit(cost: ModelCost, total_sms: int, points: list[ProfilePoint], steps: int = 3000) -> PerfModel:
    """Least squares on log(predicted / measured) over the coefficients (kept positive
    through a log parametrisation): the five of the roofline, the two floors, and for a
    mixture-of-experts model the experts' GEMM rate. Each max() is smoothed during the fit
    so that gradients reach both of its terms."""
    import torch

    start = PerfModel.default(cost, total_sms, on_gpu=total_sms > 1).coeffs
    start = replace(start, prefill_floor_ms=start.prefill_overhead_ms, decode_floor_ms=start.decode_overhead_ms,
                    expert_tflops=start.peak_tflops / 2)
    names = ["peak_tflops", "bw_max_gbs", "bw_knee_sms", "prefill_overhead_ms", "decode_overhead_ms",
             "prefill_floor_ms", "decode_floor_ms"]
    experts_apart = cost.expert_flops_per_token > 0
    if experts_apart:
        names.append("expert_tflops")
    logs = torch.tensor([math.log(max(getattr(start, n), 1e-6)) for n in names], dtype=torch.float64,
                        requires_grad=True)

    def column(values) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    prefill = [p.phase == "prefill" for p in points]
    phase = torch.tensor(prefill)
    sms = column(min(p.sms, total_sms) for p in points)
    tokens = column(p.num_tokens if pre else p.batch for p, pre in zip(points, prefill))
    pairs = column(p.attn_pairs if pre else p.total_ctx for p, pre in zip(points, prefill))
    kv_tokens = column(p.num_tokens if pre else p.total_ctx for p, pre in zip(points, prefill))
    measured = column(p.measured_ms for p in points)
    expert_flops = cost.expert_flops_per_token * tokens if experts_apart else torch.zeros_like(tokens)
    dense_flops = cost.flops_per_token * tokens - expert_flops
    weight_bytes = column(cost.step_weight_bytes(t) for t in tokens.tolist())
    expert_bytes = weight_bytes - cost.weight_bytes if experts_apart else torch.zeros_like(tokens)
    attn_flops = cost.attn_flops_per_pair * pairs
    kv_bytes = cost.kv_bytes_per_token * kv_tokens
    t = float(total_sms)

    def predict(lg, sharp: float) -> torch.Tensor:
        c = dict(zip(names, lg.exp()))
        compute = c["peak_tflops"].clamp(max=MAX_PEAK_TFLOPS) * 1e9 * sms / t
        knee = c["bw_knee_sms"]
        bandwidth = c["bw_max_gbs"] * 1e6 * sms * (t + knee) / (t * (sms + knee))

        def smooth_max(a, b):  # scaled by the measured time so `sharp` means the same everywhere
            return torch.logsumexp(torch.stack([a, b]) * sharp / measured, dim=0) * measured / sharp

        step = (smooth_max(dense_flops / compute, (weight_bytes - expert_bytes) / bandwidth)
                + smooth_max(attn_flops / compute, kv_bytes / bandwidth)
                + torch.where(phase, c["prefill_overhead_ms"], c["decode_overhead_ms"]))
        if experts_apart:
            step = step + expert_flops / (c["expert_tflops"] * 1e9 * sms / t) + expert_bytes / bandwidth
        return smooth_max(step, torch.where(phase, c["prefill_floor_ms"], c["decode_floor_ms"]))

    opt = torch.optim.Adam([logs], lr=0.05)
    for i in range(steps):
        sharp = 4.0 + 60.0 * i / steps  # smooth max -> hard max as the fit settles
        loss = ((predict(logs, sharp).log() - measured.log()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    values = dict(zip(names, logs.detach().exp().tolist()))
    values["peak_tflops"] = min(values["peak_tflops"], MAX_PEAK_TFLOPS)
    return PerfModel(cost, RooflineCoeffs(total_sms=total_sms, **values))


def median_abs_pct_error(model: PerfModel, points: list[ProfilePoint]) -> float:
    errs = sorted(abs(predict_point(model, p) - p.measured_ms) / p.measured_ms for p in points)
    n = len(errs)
    return 100.0 * (errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2)
