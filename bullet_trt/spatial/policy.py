"""SLO-aware SM split and prefill admission: a pure function of the engine's state.

Called whenever the prefill worker is free and prompts are waiting. While decode runs, prompts first gather
for a while (a bounded share of the TTFT budget) into a fuller batch: a prefill of a few
hundred tokens streams all the weights as a decode step does, and slows the decode beside it
for its whole run, so fewer, fuller batches cost decode less. Prefill gets the fewest SMs
with which the whole queue, prefilled in arrival order in capped batches, meets its TTFT
deadlines, and with which one batch takes at most half the TTFT budget (so a prompt that just
missed it still makes its own deadline); decode keeps the rest, as long as its step meets the
TPOT SLO there. Decode, the phase that runs all the time, thus gets as many SMs as TTFT allows,
and prefill batches grow with the load instead of running small and often on most of the GPU.
Decode's speed only matters while its sequence slots are scarce, though: when most are
free, its step time limits nothing but TPOT, so prefill also takes the SMs whose loss keeps
decode's step within a budget that grows from its full-GPU step toward the TPOT target as
the slots empty (`decode_step_budget`). When no split keeps the queue within TTFT, prefill
takes the most SMs whose remainder still meets TPOT. Both SLOs are planned with a margin:
decode's step beside a prefill for `tpot_plan` of the TPOT SLO (a per-step bound on what is
a per-request mean, so a plan near or above 1 can still keep the mean within the SLO), and
TTFT's for the split with a wide one (half the SLO by default), so that prompts are not
prefilled at the SLO's edge. With `serve.row_tpot_budget`, decode's step is also kept within
what its rows can afford over a prefill's planned length: a request of few tokens averages few
steps, a long one mostly steps run alone (spatial/row_pace.py).
The batch admits waiting prompts, earliest deadline first, while the predicted prefill time
keeps each within its deadline.

Once decode's dense layers are bound by math rather than by the weight stream (a large
decode batch), a prefill beside decode only takes SMs from a phase that needs them. There
the policy (`serve.fuse_prefill=auto`) fuses instead: whole waiting prompts ride along in
decode's next step, sharing its pass over the weights, as many as keep that step within the
TPOT target and the step's token budget; a prompt that does not fit goes to the prefill
partition as above. Below that batch `auto` still fuses where the model says fused steps do
the split's work sooner and drain the queue within TTFT (`fusing_outpaces_split`): an MoE decode
of a few hundred rows streams most experts each step, as the partition's prefill beside it does
again. With `serve.fuse_prompt_slices` the prompt that does not fit a fused step whole rides in
part, filling its token budget as chunked's steps do; its rest waits at the head of the queue.
Prompts may ride in decode's steps while the partition holds a prefill (decode's steps then run
on the SMs it leaves), so one path does not wait for the other. A
phase with nothing to do yields every SM, except with `serve.split_ahead`: while prompts
gather and their batch is expected within a few of decode's steps (`gathering_ends_in_ms`),
the decision names the split it is expected to get (`gathered`), and decode
moves to its complement before the prefill starts, since a move reaches decode's steps only one
or two steps after it is sent and a prefill started meanwhile shares SMs with decode's steps on
the whole GPU. The `static` policy is the fixed-split baseline behind the same signature.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from bullet_trt.protocol import SmSplit
from bullet_trt.spatial.perf_model import PerfModel, PrefillShape


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
    hold_ms: float = 0.0  # how long a prompt may wait for a fuller batch while decode runs
    batch_tokens: int = 0  # ... unless the waiting prompts already hold this many tokens
    # Decode's sequence slots (its max_num_seqs). None: unknown, and decode's step time is
    # treated as always limiting throughput (it keeps every SM that TTFT leaves it).
    decode_slots: int | None = None
    fuse: str = "never"  # never | auto | always: whether prompts may ride in decode's step
    fuse_tokens: int = 0  # tokens a fused step may hold, decode rows included (0: no cap)
    # The prompt that does not fit a fused step's token budget whole rides in part, filling it,
    # as chunked's steps carry a slice of a prompt (serve.fuse_prompt_slices); its rest waits.
    fuse_slices: bool = False
    # SMs decode runs on while a prefill already holds its partition (None: none in flight).
    # Then only a fused prefill can start: prompts ride in decode's steps on those SMs.
    beside_prefill_sms: int | None = None
    # The longest step every decoding row's TPOT can still afford (spatial/row_pace.py,
    # serve.row_tpot_budget); None: the plan's bound alone.
    row_step_ms: float | None = None
    # serve.split_ahead: while prompts gather, decode moves now to the complement of the split
    # their batch is expected to get, so that the prefill starts on SMs decode has left, once
    # the batch is expected within this many of decode's steps.
    split_ahead: bool = False
    ahead_lead_steps: float = 2.0

    @property
    def decode_step_sms(self) -> int:
        """The SMs decode's next step runs on, before this decision."""
        return self.total_sms if self.beside_prefill_sms is None else self.beside_prefill_sms


@dataclass
class SloConfig:
    ttft_ms: float
    tpot_ms: float
    margin: float = 0.85  # admission is planned for this fraction of the TTFT SLO
    # Decode's step beside a prefill is planned for this fraction of the TPOT SLO. TPOT is a
    # request's mean over its steps, and most of them run shorter than this bound (alone on
    # the GPU, or on a split TTFT did not force), so a bound above 1 can still keep the mean
    # within the SLO; it only binds when the queue forces prefill to take SMs.
    tpot_plan: float = 0.85
    # The split is chosen so that the waiting queue is prefilled within this fraction of the
    # TTFT SLO: planning for the whole budget made TTFT sit at the SLO's edge whenever
    # prefill was the busier phase (long prompts), where arrivals and prediction error pushed
    # many prompts over it.
    ttft_plan: float = 0.5

    @property
    def decode_step_ms(self) -> float:
        """The longest step decode is planned to take beside a prefill."""
        return self.tpot_ms * self.tpot_plan

    @property
    def prefill_batch_ms(self) -> float:
        """The longest a prefill batch is planned to take where TTFT can be kept: half the
        planned TTFT budget, so that a prompt that just missed one batch makes the next."""
        return self.ttft_ms * self.ttft_plan / 2


def step_target(state: PolicyState, slo: SloConfig) -> float:
    """The longest step decode is planned to take beside a prefill: the plan's share of the
    TPOT SLO, or less where the decoding rows afford less."""
    if state.row_step_ms is None:
        return slo.decode_step_ms
    return min(slo.decode_step_ms, state.row_step_ms)


@dataclass
class Decision:
    prefill_sms: int | None  # None: prefill runs alone on the whole GPU
    admit: list[int]  # indices into state.waiting, in launch order
    predicted_prefill_ms: float = 0.0
    predicted_decode_ms: float = 0.0
    fuse: bool = False  # the admitted prompts ride in decode's next step (prefill_sms None)
    # Tokens each admitted prompt prefills now, where the last is a slice of its prompt (fused
    # steps with serve.fuse_prompt_slices); None: every admitted prompt whole.
    tokens: list[int] | None = None
    # Nothing admitted yet, but prompts gather for a batch that is expected to get this
    # split: decode may move to its complement ahead of the prefill (serve.split_ahead).
    ahead_sms: int | None = None

    def decode_sms(self, total: int) -> int:
        return SmSplit(total, self.prefill_sms).decode_sms


@dataclass
class FusedAdmission:
    admit: list[int]  # indices into state.waiting, in arrival order
    tokens: list[int]  # tokens each prefills in the step: whole prompts, the last perhaps a slice
    predicted_ms: float = 0.0


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
        # A candidate may not make an admitted prompt late that the batch so far keeps on
        # time. Prompts late already set no bound: when the queue is behind, fuller batches
        # catch up faster (one-prompt batches would only fall further behind). The head
        # always goes, so nothing starves.
        on_time = [slack for slack in ((state.waiting[j].arrival - state.now) * 1e3 + slo.ttft_ms * slo.margin
                                       for j in admitted) if slack >= predicted]
        if on_time and ms > min(on_time):
            break
        admitted, predicted = candidate, ms
    return admitted, predicted


def queue_meets_ttft(state: PolicyState, slo: SloConfig, model: PerfModel, sms: int) -> bool:
    """Whether prefilling the waiting prompts (those with a decode slot to go to) in arrival
    order, in batches capped like the admission, on `sms` SMs finishes each within its TTFT
    deadline (planned at slo.ttft_plan of the SLO), with no batch longer than half that budget."""
    budget = slo.ttft_ms * slo.ttft_plan
    order = sorted(range(len(state.waiting)), key=lambda i: state.waiting[i].arrival)
    order = order[:max(0, state.free_seq_slots)]
    elapsed, start = 0.0, 0
    while start < len(order):
        end, tokens = start, 0
        while (end < len(order) and end - start < state.max_prefill_seqs
               and (end == start or tokens + state.waiting[order[end]].num_tokens <= state.max_prefill_tokens)):
            tokens += state.waiting[order[end]].num_tokens
            end += 1
        batch = [state.waiting[i] for i in order[start:end]]
        ms = model.prefill_ms(PrefillShape.of([w.num_tokens for w in batch]), sms)
        elapsed += ms
        if ms > slo.prefill_batch_ms:
            return False
        if any(elapsed > (w.arrival - state.now) * 1e3 + budget for w in batch):
            return False
        start = end
    return True


def gathering(state: PolicyState) -> bool:
    """Whether to let the waiting prompts gather into a fuller prefill batch for now: decode
    is running, the oldest prompt has waited less than hold_ms, and together they hold fewer
    than batch_tokens tokens and fit more prompts."""
    if state.decode_batch == 0 or not state.waiting or state.hold_ms <= 0:
        return False
    waited_ms = (state.now - min(w.arrival for w in state.waiting)) * 1e3
    tokens = sum(w.num_tokens for w in state.waiting)
    return (waited_ms < state.hold_ms and tokens < state.batch_tokens
            and len(state.waiting) < min(state.max_prefill_seqs, state.free_seq_slots))


def decode_step_budget(state: PolicyState, slo: SloConfig, model: PerfModel) -> float:
    """How long decode's step may take beside a prefill. Decode's speed only limits throughput
    through its slots: a sequence holds one for as many steps as it has output tokens, so when
    the slots are full, a slower step is fewer requests served, and decode keeps its full-GPU
    step time. When most slots are free (long prompts with short outputs, light load), a
    slower step costs nothing but TPOT, and the budget grows toward the TPOT target in
    proportion to the slots neither held nor claimed by a waiting prompt; prefill, then the
    phase that bounds the rate, gets the SMs."""
    target = step_target(state, slo)
    full = model.decode_ms(state.decode_batch, state.decode_total_ctx, state.total_sms)
    if state.decode_slots is None or full >= target:
        return min(full, target)
    slots = max(state.decode_slots, 1)
    claimed = slots - min(state.free_seq_slots, slots) + len(state.waiting)
    occupancy = min(1.0, claimed / slots)
    return full + (target - full) * (1.0 - occupancy)


def fuses(state: PolicyState, model: PerfModel) -> bool:
    """Whether prompts may ride in decode's next step whatever the split would do: always, or
    (auto) while decode's dense layers are bound by math there."""
    if state.decode_batch == 0 or state.fuse == "never":
        return False
    return state.fuse == "always" or model.decode_gemms_compute_bound(state.decode_batch, state.decode_step_sms)


class SplitPlan:
    """The split a decision plans for the waiting queue beside decode (prefill's SMs, the batch it
    admits, its predicted time), planned at most once a decision: fused admission compares it, and
    the split path takes it."""

    def __init__(self, state: PolicyState, slo: SloConfig, model: PerfModel):
        self.state, self.slo, self.model = state, slo, model

    @functools.cached_property
    def planned(self) -> tuple[int, list[int], float]:
        prefill_sms = choose_split(self.state, self.slo, self.model)
        admit, prefill_ms = _admit(self.state, self.slo, self.model, prefill_sms)
        return prefill_sms, admit, prefill_ms


def fusing_outpaces_split(state: PolicyState, slo: SloConfig, model: PerfModel, fused: FusedAdmission,
                          split: SplitPlan) -> bool:
    """serve.fuse_prefill=auto, below the math-bound batch: whether fused steps do the split's
    work sooner than the split. The split prefills its batch on a partition while decode steps
    beside it; fused steps like this one prefill as many tokens, each also a decode step, and
    decode's steps alone on the whole GPU make up the difference in steps (or are saved).
    Where decode's rows are few and each step streams most of an MoE model's experts, a
    partitioned prefill and the decode beside it each stream the weights and share the memory
    bandwidth, while a fused step streams them once: chunked's mixed steps sustained more of the
    Azure-conversation-like load than the split on one H200 (docs/benchmarks.md). Only on the
    whole GPU (a fused step beside a partition's prefill runs on decode's few SMs), and only
    while fused steps alone keep the waiting queue within TTFT."""
    if state.beside_prefill_sms is not None or not state.splits or not fused_steps_meet_ttft(state, slo, model):
        return False
    prefill_sms, batch, prefill_ms = split.planned
    beside_ms = _decode_ms(state, model, prefill_sms)
    split_ms = max(prefill_ms, beside_ms)
    alone_ms = model.decode_ms(state.decode_batch, state.decode_total_ctx, state.total_sms)
    fused_steps = sum(state.waiting[i].num_tokens for i in batch) / sum(fused.tokens)
    return fused_steps * fused.predicted_ms + (split_ms / beside_ms - fused_steps) * alone_ms < split_ms


def fused_steps_meet_ttft(state: PolicyState, slo: SloConfig, model: PerfModel) -> bool:
    """Whether fused steps, one after another, each admitting what the next would, prefill the
    waiting prompts within their TTFT deadlines (planned as queue_meets_ttft plans the split's).
    A fused step holds only what fits beside decode's rows, so a queue that has grown drains
    faster through the split's fuller batches; prompts too long to ride at all go to the
    partition whatever this says."""
    budget = slo.ttft_ms * slo.ttft_plan
    elapsed, left = 0.0, state
    while left.waiting and left.free_seq_slots > 0:
        fused = _admit_fused(left, slo, model)
        if not fused.admit:
            return True
        elapsed += fused.predicted_ms
        done = [i for i, n in zip(fused.admit, fused.tokens) if n == left.waiting[i].num_tokens]
        if any(elapsed > (left.waiting[i].arrival - state.now) * 1e3 + budget for i in done):
            return False
        # a sliced prompt's rest rides first in the next step (its arrival keeps it at the head)
        rest = [w if k not in fused.admit else replace(w, num_tokens=w.num_tokens - fused.tokens[-1])
                for k, w in enumerate(left.waiting) if k not in done]
        left = replace(left, waiting=rest, free_seq_slots=left.free_seq_slots - len(done))
    return True


def _admit_fused(state: PolicyState, slo: SloConfig, model: PerfModel) -> FusedAdmission:
    """Waiting prompts in arrival order, whole, while decode's step with them stays within
    the token budget and (unless fusing always) the TPOT target; with state.fuse_slices the
    first prompt that does not fit the budget whole rides in part, filling it."""
    order = sorted(range(len(state.waiting)), key=lambda i: state.waiting[i].arrival)
    taken = FusedAdmission([], [])

    def fits(tokens: list[int]) -> float | None:
        ms = model.fused_ms(state.decode_batch, state.decode_total_ctx, PrefillShape.of(tokens), state.decode_step_sms)
        return ms if state.fuse == "always" or ms <= step_target(state, slo) else None

    for i in order[:max(0, state.free_seq_slots)]:
        n = state.waiting[i].num_tokens
        room = state.fuse_tokens - state.decode_batch - sum(taken.tokens) if state.fuse_tokens else n
        part = n if n <= room else (room if state.fuse_slices and room > 0 else 0)
        ms = fits(taken.tokens + [part]) if part else None
        if ms is None:
            break
        taken.admit.append(i)
        taken.tokens.append(part)
        taken.predicted_ms = ms
        if part < n:
            break
    return taken


def bullet_policy(state: PolicyState, slo: SloConfig, model: PerfModel) -> Decision:
    if not state.waiting or state.free_seq_slots <= 0:
        return Decision(prefill_sms=None, admit=[])
    split = SplitPlan(state, slo, model)
    if state.fuse != "never" and state.decode_batch:
        fused = _admit_fused(state, slo, model)
        if fused.admit and (fuses(state, model) or fusing_outpaces_split(state, slo, model, fused, split)):
            sliced = fused.tokens[-1] < state.waiting[fused.admit[-1]].num_tokens  # only the last may be
            return Decision(None, fused.admit, predicted_prefill_ms=fused.predicted_ms,
                            predicted_decode_ms=fused.predicted_ms, fuse=True,
                            tokens=fused.tokens if sliced else None)
    if state.beside_prefill_sms is not None:  # the partition is taken: prompts wait for it
        return Decision(prefill_sms=None, admit=[])
    if gathering(state):
        ahead = choose_split(gathered(state), slo, model) if _due_ahead(state, model) else None
        return Decision(prefill_sms=None, admit=[], ahead_sms=ahead)
    if state.decode_batch == 0 or not state.splits:  # alone, or nothing to split (CPU)
        admit, ms = _admit(state, slo, model, state.total_sms)
        return Decision(None, admit, predicted_prefill_ms=ms)
    chosen, admit, pre_ms = split.planned
    return Decision(chosen, admit, predicted_prefill_ms=pre_ms, predicted_decode_ms=_decode_ms(state, model, chosen))


def _decode_ms(state: PolicyState, model: PerfModel, prefill_sms: int) -> float:
    return model.decode_ms(state.decode_batch, state.decode_total_ctx,
                           SmSplit(state.total_sms, prefill_sms).decode_sms)


def choose_split(state: PolicyState, slo: SloConfig, model: PerfModel) -> int:
    """Prefill's SMs for the waiting queue, beside a running decode (state.splits not empty)."""
    target = step_target(state, slo)
    tpot_ok = [s for s in state.splits if _decode_ms(state, model, s) <= target]
    # Fewest prefill SMs that keep TTFT; decode keeps the rest (if that meets TPOT) ...
    chosen = next((s for s in tpot_ok if queue_meets_ttft(state, slo, model, s)), None)
    if chosen is None:
        # TTFT is at risk: prefill takes what decode can spare and stay within TPOT, or,
        # when no split meets TPOT, as little as the partitioner offers.
        return tpot_ok[-1] if tpot_ok else state.splits[0]
    # ... unless decode cannot use them: prefill also takes every SM that decode can
    # give up with its step still within its budget.
    budget = decode_step_budget(state, slo, model)
    spare = [s for s in tpot_ok if _decode_ms(state, model, s) <= budget]
    return max(chosen, spare[-1]) if spare else chosen


def _due_ahead(state: PolicyState, model: PerfModel) -> bool:
    """serve.split_ahead: the gathering batch is expected within ahead_lead_steps of decode's
    steps, so decode moves off its SMs now."""
    if not (state.split_ahead and state.splits):
        return False
    step_ms = model.decode_ms(state.decode_batch, state.decode_total_ctx, state.decode_step_sms)
    return gathering_ends_in_ms(state) <= state.ahead_lead_steps * step_ms


def gathering_ends_in_ms(state: PolicyState) -> float:
    """When the gathering is expected to end: the oldest prompt's hold running out, or sooner
    the waiting prompts reaching batch_tokens or the batch's prompt count, at the pace the
    prompts after the oldest arrived (none after it yet: the hold alone)."""
    oldest = min(state.waiting, key=lambda w: w.arrival)
    waited_ms = (state.now - oldest.arrival) * 1e3
    ends = state.hold_ms - waited_ms
    if len(state.waiting) > 1 and waited_ms > 0:
        tokens = sum(w.num_tokens for w in state.waiting)
        since = tokens - oldest.num_tokens
        if since > 0:
            ends = min(ends, (state.batch_tokens - tokens) * waited_ms / since)
        room = min(state.max_prefill_seqs, state.free_seq_slots) - len(state.waiting)
        ends = min(ends, room * waited_ms / (len(state.waiting) - 1))
    return max(0.0, ends)


def gathered(state: PolicyState) -> PolicyState:
    """The state as the gathering is expected to end: the waiting prompts and, if they hold
    fewer than batch_tokens, one more prompt arriving now with the rest. A guess at the
    batch that will start, for the split decode moves to ahead of it: the queue grows while
    it gathers, and a batch that outgrows the guess shares SMs with decode for the steps
    that its move takes."""
    missing = state.batch_tokens - sum(w.num_tokens for w in state.waiting)
    if missing <= 0:
        return state
    return replace(state, waiting=[*state.waiting, WaitingPrompt(state.now, missing)])


def static_policy(state: PolicyState, slo: SloConfig, model: PerfModel, prefill_sms: int) -> Decision:
    if not state.waiting or state.free_seq_slots <= 0:
        return Decision(prefill_sms=prefill_sms, admit=[])
    admit, ms = _admit(state, slo, model, prefill_sms)
    return Decision(prefill_sms, admit, predicted_prefill_ms=ms,
                    predicted_decode_ms=model.decode_ms(state.decode_batch, state.decode_total_ctx,
                                                        SmSplit(state.total_sms, prefill_sms).decode_sms))
