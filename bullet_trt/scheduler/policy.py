"""SLO-aware SM split and prefill admission: a pure function of the engine's state.

Called whenever the prefill worker is free and prompts are waiting. Decode gets the fewest SMs
whose predicted step time meets the TPOT SLO (with a safety margin); prefill gets the rest and
admits waiting prompts, earliest TTFT deadline first, while the predicted prefill time keeps
every admitted prompt within its deadline. A phase with nothing to do yields every SM.
The `static` policy is the fixed-split baseline behind the same signature.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bullet_trt.scheduler.perf_model import PerfModel, PrefillShape


@dataclass
class WaitingPrompt:
    arrival: float  # seconds, same clock as PolicyState.now
    num_tokens: int  # tokens the prefill must compute (prompt plus any recomputed output)


@dataclass
class PolicyState:
    now: float
    total_sms: int
    splits: list[int]  # prefill SM counts the partitioner offers, ascending
    decode_batch: int
    decode_total_ctx: int
    waiting: list[WaitingPrompt] = field(default_factory=list)
    max_prefill_tokens: int = 8192
    max_prefill_seqs: int = 8
    free_seq_slots: int = 1 << 30  # decode slots left for newly prefilled sequences


@dataclass
class SloConfig:
    ttft_ms: float
    tpot_ms: float
    margin: float = 0.85  # plan for this fraction of each SLO


@dataclass
class Decision:
    prefill_sms: int | None  # None: prefill runs alone on the whole GPU
    admit: list[int]  # indices into state.waiting, in launch order
    predicted_prefill_ms: float = 0.0
    predicted_decode_ms: float = 0.0

    def decode_sms(self, total: int) -> int:
        return total if self.prefill_sms is None else total - self.prefill_sms


def _admit(state: PolicyState, slo: SloConfig, model: PerfModel, sms: int) -> tuple[list[int], float]:
    order = sorted(range(len(state.waiting)), key=lambda i: state.waiting[i].arrival)
    admitted: list[int] = []
    predicted = 0.0
    limit = min(state.max_prefill_seqs, state.free_seq_slots)
    for i in order:
        if len(admitted) >= limit:
            break
        candidate = admitted + [i]
        tokens = [state.waiting[j].num_tokens for j in candidate]
        if admitted and sum(tokens) > state.max_prefill_tokens:
            break
        ms = model.prefill_ms(PrefillShape.of(tokens), sms)
        # Deadline of the earliest admitted prompt bounds the batch; the head always goes,
        # late or not, so nothing starves.
        slack_ms = min((state.waiting[j].arrival - state.now) * 1e3 + slo.ttft_ms * slo.margin
                       for j in candidate)
        if admitted and ms > slack_ms:
            break
        admitted, predicted = candidate, ms
    return admitted, predicted


def bullet_policy(state: PolicyState, slo: SloConfig, model: PerfModel) -> Decision:
    if not state.waiting or state.free_seq_slots <= 0:
        return Decision(prefill_sms=None, admit=[])
    if state.decode_batch == 0 or not state.splits:  # alone, or nothing to split (CPU)
        admit, ms = _admit(state, slo, model, state.total_sms)
        return Decision(None, admit, predicted_prefill_ms=ms)
    budget = slo.tpot_ms * slo.margin
    chosen = state.splits[0]  # decode keeps the most SMs if no split meets the SLO
    decode_ms = model.decode_ms(state.decode_batch, state.decode_total_ctx, state.total_sms - chosen)
    for prefill_sms in reversed(state.splits):  # most SMs for prefill first
        ms = model.decode_ms(state.decode_batch, state.decode_total_ctx, state.total_sms - prefill_sms)
        if ms <= budget:
            chosen, decode_ms = prefill_sms, ms
            break
    admit, pre_ms = _admit(state, slo, model, chosen)
    return Decision(chosen, admit, predicted_prefill_ms=pre_ms, predicted_decode_ms=decode_ms)


def static_policy(state: PolicyState, slo: SloConfig, model: PerfModel, prefill_sms: int) -> Decision:
    if not state.waiting or state.free_seq_slots <= 0:
        return Decision(prefill_sms=prefill_sms, admit=[])
    admit, ms = _admit(state, slo, model, prefill_sms)
    return Decision(prefill_sms, admit, predicted_prefill_ms=ms,
                    predicted_decode_ms=model.decode_ms(state.decode_batch, state.decode_total_ctx,
                                                        state.total_sms - prefill_sms))
