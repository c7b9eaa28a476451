"""The Bullet policy on synthetic states: TTFT- and TPOT-driven split, deadline admission, idle
phases."""
from __future__ import annotations

import pytest

from bullet_trt.model.arch import ModelArch
from bullet_trt.model.presets import PRESETS
from bullet_trt.spatial.perf_model import ModelCost, PerfModel, PrefillShape, RooflineCoeffs
from bullet_trt.spatial.policy import (PolicyState, SloConfig, WaitingPrompt, bullet_policy,
                                         decode_step_budget, fused_steps_meet_ttft, gathering_ends_in_ms,
                                         queue_meets_ttft, static_policy)
from tests.test_perf_model import COST, TRUE

MODEL = PerfModel(COST, TRUE)
SPLITS = list(range(8, 132, 8))
SLO = SloConfig(ttft_ms=1000.0, tpot_ms=50.0)


def state(decode_batch=32, ctx=1024, waiting=((0.0, 1024),), now=0.0, **kw) -> PolicyState:
    return PolicyState(now=now, total_sms=132, splits=SPLITS, decode_batch=decode_batch,
                       decode_total_ctx=decode_batch * ctx,
                       waiting=[WaitingPrompt(a, n) for a, n in waiting], **kw)


def test_prefill_gets_the_fewest_sms_that_keep_the_queue_within_ttft():
    queue = tuple((0.0, 2048) for _ in range(8))
    st = state(waiting=queue, max_prefill_seqs=4)
    d = bullet_policy(st, SLO, MODEL)
    assert d.prefill_sms > SPLITS[0]  # this queue needs more than the smallest split
    assert queue_meets_ttft(st, SLO, MODEL, d.prefill_sms)
    assert not queue_meets_ttft(st, SLO, MODEL, d.prefill_sms - 8)
    assert d.predicted_decode_ms <= SLO.tpot_ms * SLO.tpot_plan
    assert d.admit == [0, 1, 2, 3]  # the first capped batch, in arrival order


def test_light_queue_leaves_decode_the_most_sms():
    d = bullet_policy(state(waiting=((0.0, 128),)), SLO, MODEL)
    assert d.prefill_sms == SPLITS[0] and d.decode_sms(132) == 124


def test_more_waiting_work_takes_more_prefill_sms():
    def split_for(n: int) -> int:
        return bullet_policy(state(waiting=tuple((0.0, 1024) for _ in range(n))), SLO, MODEL).prefill_sms
    sms = [split_for(n) for n in (1, 4, 8, 16)]
    assert sms == sorted(sms) and sms[-1] > sms[0]


def test_one_batch_may_take_only_half_the_ttft_budget():
    """A 4096-token prompt that would meet its own deadline on fewer SMs still gets enough
    SMs to finish within half the budget, so a prompt arriving behind it can make its own."""
    st = state(waiting=((0.0, 4096),))
    budget = SLO.ttft_ms * SLO.ttft_plan
    slow = [s for s in SPLITS if budget / 2 < MODEL.prefill_ms(PrefillShape.of([4096]), s) <= budget]
    assert slow  # the case exists in this model
    assert not any(queue_meets_ttft(st, SLO, MODEL, s) for s in slow)
    d = bullet_policy(st, SLO, MODEL)
    assert d.prefill_sms > max(slow)
    assert MODEL.prefill_ms(PrefillShape.of([4096]), d.prefill_sms) <= budget / 2


LATE = ((-5.0, 4096), (-4.0, 4096))  # past their deadlines whatever the split


def test_ttft_at_risk_prefill_takes_what_decode_can_spare():
    d = bullet_policy(state(waiting=LATE), SLO, MODEL)
    decode_sms = d.decode_sms(132)
    assert MODEL.decode_ms(32, 32 * 1024, decode_sms) <= SLO.tpot_ms * SLO.tpot_plan
    # one granule fewer would miss the (margined) SLO, unless decode is already at the minimum
    if d.prefill_sms < SPLITS[-1]:
        assert MODEL.decode_ms(32, 32 * 1024, decode_sms - 8) > SLO.tpot_ms * SLO.tpot_plan
    assert d.predicted_decode_ms <= SLO.tpot_ms


def test_stale_corrections_stop_pinning_prefill_to_its_smallest_share():
    """The trap seen at 60 req/s: decode on 84-100 SMs once ran 3.2x its roofline (beside
    small batches), on 108 it runs 1.3x now. While the old corrections hold, no split beyond
    24 prefill SMs meets TPOT, and the late queue gets 24; once they have gone stale, the
    fresh correction of 108 stands in, and prefill gets what decode can really spare."""
    model = PerfModel(COST, TRUE, stale_after=100)
    rows, ctx = 520, 500
    for sms in (84, 92, 100):
        for _ in range(20):
            model.observe("decode", model.decode_ms(rows, rows * ctx, sms),
                          3.2 * model._decode_raw(rows, rows * ctx, sms), sms)
    late = state(decode_batch=rows, ctx=ctx, waiting=LATE)

    def observe_108() -> None:
        model.observe("decode", model.decode_ms(rows, rows * ctx, 108),
                      1.3 * model._decode_raw(rows, rows * ctx, 108), 108)

    for _ in range(40):
        observe_108()
    assert bullet_policy(late, SLO, model).prefill_sms == 24
    for _ in range(100):
        observe_108()
    d = bullet_policy(late, SLO, model)
    assert d.prefill_sms > 24
    assert d.predicted_decode_ms <= SLO.tpot_ms * SLO.tpot_plan


def test_tighter_tpot_gives_decode_more_sms():
    loose = bullet_policy(state(decode_batch=128, ctx=2048, waiting=LATE), SloConfig(1000, 60), MODEL)
    tight = bullet_policy(state(decode_batch=128, ctx=2048, waiting=LATE), SloConfig(1000, 25), MODEL)
    assert tight.decode_sms(132) > loose.decode_sms(132)


def test_a_looser_tpot_plan_lets_a_late_queue_take_more_sms():
    """serve.tpot_plan_fraction bounds decode's step beside a prefill; above the SLO's own
    margin, prefill takes more of the SMs when the queue is late, and the plan is all the TPOT
    SLO enters: a 60 ms SLO planned at 0.85 decides as a 50 ms SLO planned at 1.02."""
    late = state(decode_batch=512, ctx=500, waiting=LATE)
    default = bullet_policy(late, SLO, MODEL)
    looser = bullet_policy(late, SloConfig(1000.0, 50.0, tpot_plan=1.02), MODEL)
    assert looser.prefill_sms > default.prefill_sms
    assert default.predicted_decode_ms <= 50.0 * 0.85 < looser.predicted_decode_ms <= 50.0 * 1.02
    for st in (late, state(waiting=((0.0, 1024),) * 6), state(decode_batch=900, ctx=300, waiting=LATE),
               state(decode_batch=64, waiting=((0.0, 4096),), decode_slots=1024, free_seq_slots=960)):
        a = bullet_policy(st, SloConfig(1000.0, 60.0, tpot_plan=0.85), MODEL)
        b = bullet_policy(st, SloConfig(1000.0, 50.0, tpot_plan=1.02), MODEL)
        assert (a.prefill_sms, a.admit) == (b.prefill_sms, b.admit)


def test_unreachable_tpot_keeps_prefill_at_the_minimum():
    d = bullet_policy(state(decode_batch=256, ctx=4096), SloConfig(1000, 1.0), MODEL)
    assert d.prefill_sms == SPLITS[0]


def test_idle_phases_yield_every_sm():
    no_decode = bullet_policy(state(decode_batch=0), SLO, MODEL)
    assert no_decode.prefill_sms is None and no_decode.admit == [0]
    no_prefill = bullet_policy(state(waiting=()), SLO, MODEL)
    assert no_prefill.prefill_sms is None and no_prefill.admit == []


def test_admission_respects_deadlines_and_budgets():
    # ten 2048-token prompts that arrived 0.5 s ago: only a few fit in the remaining slack
    many = tuple((-0.5 + i * 0.001, 2048) for i in range(10))
    d = bullet_policy(state(waiting=many, max_prefill_tokens=1 << 20, max_prefill_seqs=64), SLO, MODEL)
    assert 1 <= len(d.admit) < 10
    assert d.admit == sorted(d.admit)  # earliest deadline first
    tokens = [2048] * len(d.admit)
    slack = -0.5 * 1e3 + SLO.ttft_ms * SLO.margin
    assert len(d.admit) == 1 or MODEL.prefill_ms(PrefillShape.of(tokens), d.prefill_sms) <= slack + 1e-9
    assert MODEL.prefill_ms(PrefillShape.of(tokens + [2048]), d.prefill_sms) > slack
    # the token budget and the free decode slots cap the batch too
    fresh = tuple((0.0, 1000) for _ in range(10))
    assert len(bullet_policy(state(waiting=fresh, max_prefill_tokens=3000), SLO, MODEL).admit) == 3
    assert len(bullet_policy(state(waiting=fresh, free_seq_slots=2), SLO, MODEL).admit) == 2
    assert bullet_policy(state(waiting=fresh, free_seq_slots=0), SLO, MODEL).admit == []


def test_late_head_still_admitted():
    d = bullet_policy(state(waiting=((-5.0, 4096), (-4.0, 4096))), SLO, MODEL)
    assert d.admit[0] == 0


def test_a_late_queue_is_prefilled_in_full_batches():
    """Prompts already past their deadline do not bound the batch: one-prompt batches would
    only fall further behind."""
    late = tuple((-2.0 + i * 0.001, 512) for i in range(20))
    d = bullet_policy(state(waiting=late, max_prefill_seqs=8), SLO, MODEL)
    assert d.admit == list(range(8))
    # behind them, a fresh prompt still bounds what joins it
    fresh = late[:4] + tuple((0.001 * i, 4096) for i in range(16))
    d = bullet_policy(state(waiting=fresh, max_prefill_seqs=20, max_prefill_tokens=1 << 20), SLO, MODEL)
    assert 5 <= len(d.admit) < 20


def test_static_policy_never_moves_the_split():
    for s in (state(), state(decode_batch=0), state(decode_batch=256, ctx=4096)):
        assert static_policy(s, SLO, MODEL, prefill_sms=64).prefill_sms == 64


def test_without_partitioning_prefill_is_never_split():
    s = state()
    s.splits = []
    d = bullet_policy(s, SLO, MODEL)
    assert d.prefill_sms is None and d.admit == [0]


def test_short_prompts_gather_into_a_fuller_batch_while_decode_runs():
    hold = dict(hold_ms=200.0, batch_tokens=1024, max_prefill_seqs=16)
    short = ((0.0, 150), (0.05, 200))
    # 100 ms after the first arrival, 350 tokens: wait for more
    assert bullet_policy(state(waiting=short, now=0.1, **hold), SLO, MODEL).admit == []
    # the oldest has waited its share of the TTFT budget: go with what is there
    assert bullet_policy(state(waiting=short, now=0.21, **hold), SLO, MODEL).admit == [0, 1]
    # enough tokens, or as many prompts as a batch takes: go at once
    full = tuple((0.0, 300) for _ in range(4))
    assert bullet_policy(state(waiting=full, now=0.01, **hold), SLO, MODEL).admit == [0, 1, 2, 3]
    capped = dict(hold, max_prefill_seqs=2)
    assert bullet_policy(state(waiting=short, now=0.1, **capped), SLO, MODEL).admit == [0, 1]
    # no decode to protect: prefill on the whole GPU at once
    alone = bullet_policy(state(decode_batch=0, waiting=short, now=0.1, **hold), SLO, MODEL)
    assert alone.admit == [0, 1] and alone.prefill_sms is None
    # gathering off
    assert bullet_policy(state(waiting=short, now=0.1, **dict(hold, hold_ms=0.0)), SLO, MODEL).admit == [0, 1]


def test_while_prompts_gather_decode_may_move_ahead_to_the_split_their_batch_will_get():
    """serve.split_ahead: a gathering decision admits nothing but names the split of the batch
    the hold waits for (the prompts there, topped up to batch_tokens by one arriving now); when
    that prompt does arrive, the batch starts at once on exactly that split, so decode, moved
    to its complement meanwhile, has left the prefill's SMs already."""
    # a lead longer than the hold: the batch counts as due from the start (the gate: below)
    hold = dict(hold_ms=200.0, batch_tokens=3072, max_prefill_seqs=16, split_ahead=True, ahead_lead_steps=1e6)
    short = ((0.0, 150), (0.05, 200))
    gathering = bullet_policy(state(waiting=short, now=0.1, **hold), SLO, MODEL)
    assert gathering.admit == [] and gathering.prefill_sms is None
    assert gathering.ahead_sms in SPLITS
    # the expected prompt arrives: the batch goes now, on the split decode moved ahead to
    filled = bullet_policy(state(waiting=short + ((0.1, 3072 - 350),), now=0.1, **hold), SLO, MODEL)
    assert filled.admit == [0, 1, 2] and filled.prefill_sms == gathering.ahead_sms
    # the two short prompts alone would get less: the guess is for the batch, not the queue
    alone = bullet_policy(state(waiting=short, now=0.1, **dict(hold, hold_ms=0.0)), SLO, MODEL)
    assert alone.prefill_sms < gathering.ahead_sms
    # off by default, and nothing to name without splits or while nothing gathers
    assert bullet_policy(state(waiting=short, now=0.1, **dict(hold, split_ahead=False)), SLO, MODEL).ahead_sms is None
    no_splits = state(waiting=short, now=0.1, **hold)
    no_splits.splits = []
    assert bullet_policy(no_splits, SLO, MODEL).ahead_sms is None
    assert bullet_policy(state(waiting=short, now=0.21, **hold), SLO, MODEL).ahead_sms is None


def test_a_tighter_ttft_plan_gives_prefill_more_sms():
    """Long prompts arriving together: planned against the whole TTFT budget, the fewest
    SMs leave the last prompt near its deadline; the default plan (half the SLO) takes more."""
    queue = tuple((0.0, 2048) for _ in range(4))
    edge = bullet_policy(state(waiting=queue), SloConfig(1000.0, 50.0, ttft_plan=0.85), MODEL)
    planned = bullet_policy(state(waiting=queue), SLO, MODEL)
    assert SLO.ttft_plan == 0.5
    assert planned.prefill_sms > edge.prefill_sms
    assert queue_meets_ttft(state(waiting=queue), SLO, MODEL, planned.prefill_sms)


def test_decode_with_free_slots_gives_prefill_the_sms_it_cannot_use():
    """Long prompts, short outputs (code completion): a handful of decoding sequences in 256
    slots. Their step is bound by the weight stream, so the SMs that only TTFT's minimum left
    them go to prefill, as far as the step stays within its budget and the TPOT target."""
    prompt = ((0.0, 2048),)
    legacy = bullet_policy(state(decode_batch=4, ctx=2048, waiting=prompt), SLO, MODEL)
    st = state(decode_batch=4, ctx=2048, waiting=prompt, decode_slots=256, free_seq_slots=252)
    d = bullet_policy(st, SLO, MODEL)
    assert d.prefill_sms > legacy.prefill_sms
    budget = decode_step_budget(st, SLO, MODEL)
    full = MODEL.decode_ms(4, 4 * 2048, 132)
    assert full < budget < SLO.tpot_ms * SLO.tpot_plan
    assert d.predicted_decode_ms <= budget
    # the most such SMs: one granule more would break the budget, or there is none more
    if d.prefill_sms < SPLITS[-1]:
        assert MODEL.decode_ms(4, 4 * 2048, 132 - d.prefill_sms - 8) > budget


def test_full_decode_slots_keep_decode_every_sm_ttft_leaves():
    """Slots full or claimed by the queue: decode's step is the rate limit, and the split is
    TTFT's minimum, as when the slots are unknown."""
    queue = tuple((0.0, 512) for _ in range(4))
    legacy = bullet_policy(state(decode_batch=250, ctx=600, waiting=queue), SLO, MODEL)
    full = state(decode_batch=250, ctx=600, waiting=queue, decode_slots=256, free_seq_slots=4)
    assert decode_step_budget(full, SLO, MODEL) == MODEL.decode_ms(250, 250 * 600, 132)
    assert bullet_policy(full, SLO, MODEL).prefill_sms == legacy.prefill_sms


def test_prefill_share_shrinks_as_decode_slots_fill():
    queue = ((0.0, 1024),)

    def split_for(batch: int) -> int:
        st = state(decode_batch=batch, ctx=800, waiting=queue, decode_slots=512, free_seq_slots=512 - batch)
        return bullet_policy(st, SLO, MODEL).prefill_sms
    sms = [split_for(b) for b in (8, 64, 192, 320, 448, 511)]
    assert sms == sorted(sms, reverse=True) and sms[0] > sms[-1]


def test_large_decode_batch_fuses_prompts_into_its_step():
    """Past the batch where decode's dense layers are bound by math, short prompts ride in
    decode's step (as many as keep it within the TPOT target); below it, they get a
    partition; `never` keeps the partition."""
    short = tuple((0.0, 160) for _ in range(40))
    big = state(decode_batch=512, ctx=600, waiting=short, fuse="auto", fuse_tokens=2048)
    small = state(decode_batch=16, ctx=600, waiting=short, fuse="auto", fuse_tokens=2048)
    assert MODEL.decode_gemms_compute_bound(512, 132) and not MODEL.decode_gemms_compute_bound(16, 132)
    d = bullet_policy(big, SLO, MODEL)
    assert d.fuse and d.prefill_sms is None and 0 < len(d.admit) < len(short)
    assert d.admit == sorted(d.admit)  # arrival order (all arrived at once: index order)
    target = SLO.tpot_ms * SLO.tpot_plan
    fused = lambda n: MODEL.fused_ms(512, 512 * 600, PrefillShape.of([160] * n), 132)  # noqa: E731
    assert d.predicted_prefill_ms == fused(len(d.admit)) <= target < fused(len(d.admit) + 1)
    assert not bullet_policy(small, SLO, MODEL).fuse
    assert not bullet_policy(state(decode_batch=512, ctx=600, waiting=short), SLO, MODEL).fuse


def test_while_the_partition_holds_a_prefill_prompts_may_only_ride_in_decodes_step():
    """A prefill in flight leaves decode 100 SMs: prompts fuse into decode's steps there, as
    many as keep a step on those SMs within the TPOT target; nothing goes to the partition."""
    short = tuple((0.0, 160) for _ in range(40))
    beside = state(decode_batch=512, ctx=600, waiting=short, fuse="auto", fuse_tokens=2048,
                   beside_prefill_sms=100)
    assert MODEL.decode_gemms_compute_bound(512, 100)
    d = bullet_policy(beside, SLO, MODEL)
    assert d.fuse and d.prefill_sms is None and d.admit
    on_100 = lambda n: MODEL.fused_ms(512, 512 * 600, PrefillShape.of([160] * n), 100)  # noqa: E731
    assert d.predicted_prefill_ms == on_100(len(d.admit)) <= SLO.tpot_ms * SLO.tpot_plan
    whole = bullet_policy(state(decode_batch=512, ctx=600, waiting=short, fuse="auto", fuse_tokens=2048),
                          SLO, MODEL)
    assert len(whole.admit) > len(d.admit)  # on all 132 SMs more prompts fit the target
    never = state(decode_batch=512, ctx=600, waiting=short, beside_prefill_sms=100)
    assert bullet_policy(never, SLO, MODEL).admit == []  # no fusing: the queue waits for the partition


def test_fused_step_respects_its_token_budget_and_long_prompts_take_a_partition():
    st = state(decode_batch=512, ctx=600, waiting=((0.0, 100), (0.0, 100), (0.0, 100)),
               fuse="always", fuse_tokens=512 + 250)
    d = bullet_policy(st, SLO, MODEL)
    assert d.fuse and d.admit == [0, 1]  # a third prompt would exceed 762 tokens
    long_head = state(decode_batch=512, ctx=600, waiting=((0.0, 3000), (0.0, 100)), fuse="auto",
                      fuse_tokens=2048)
    d = bullet_policy(long_head, SLO, MODEL)
    assert not d.fuse and d.prefill_sms is not None and 0 in d.admit


# Qwen3-30B-A3B with FP8 experts and activations over an FP8 KV pool on an H200: the
# calibration a server measured at start in the thirty-fourth round (docs/data/gpu_round_2026-11-29e)
H200_W8A8 = RooflineCoeffs(total_sms=132, peak_tflops=261.33, bw_max_gbs=3910.9, bw_knee_sms=75.63,
                           prefill_overhead_ms=0.669, decode_overhead_ms=3.645, prefill_floor_ms=0.698,
                           decode_floor_ms=6.201, expert_tflops=8714.9)


MOE_SLO = SloConfig(ttft_ms=1000.0, tpot_ms=50.0, tpot_plan=1.0)


def h200_w8a8_model() -> PerfModel:
    cost = ModelCost.from_arch(ModelArch.from_hf_dict(PRESETS["qwen3-30b-a3b"]), 2, fp8_experts=True,
                               kv_dtype_bytes=1)
    return PerfModel(cost, H200_W8A8)


def moe_state(rows, prompts, **kw) -> PolicyState:
    return PolicyState(now=0.0, total_sms=132, splits=list(range(16, 124, 4)), decode_batch=rows,
                       decode_total_ctx=rows * 1300, waiting=[WaitingPrompt(0.0, n) for n in prompts],
                       fuse_tokens=2048, decode_slots=1024, free_seq_slots=1024 - rows, **kw)


@pytest.mark.parametrize("rows, fused", [(64, True), (240, True), (512, False)])
def test_few_moe_decode_rows_take_a_prompt_into_their_step_where_a_split_streams_the_experts_twice(rows, fused):
    """The Azure-conversation-like load's state on the MoE (three prompts of ~1000 tokens, a few
    hundred rows of ~1300): a partitioned prefill and the decode beside it each stream the
    experts, one fused step streams them once, so `auto` fuses what its token budget holds
    (one prompt beside the rows) where the model says the fused steps do the split's work
    sooner, and leaves the split where it does not (512 rows). Beside a partition's prefill
    decode has few SMs, so nothing rides there; `never` always splits."""
    model, slo = h200_w8a8_model(), MOE_SLO
    assert not model.decode_gemms_compute_bound(rows, 132)  # the older rule would never fuse here
    d = bullet_policy(moe_state(rows, [1000] * 3, fuse="auto"), slo, model)
    assert d.fuse == fused
    if fused:
        assert d.prefill_sms is None and d.admit == [0]
        assert d.predicted_prefill_ms == model.fused_ms(rows, rows * 1300, PrefillShape.of([1000]), 132)
    else:
        assert d.prefill_sms is not None and d.admit == [0, 1, 2]
    split = bullet_policy(moe_state(rows, [1000] * 3), slo, model)
    assert not split.fuse and split.prefill_sms is not None and split.admit == [0, 1, 2]
    assert bullet_policy(moe_state(rows, [1000] * 3, fuse="auto", beside_prefill_sms=88), slo, model).admit == []
    too_long = bullet_policy(moe_state(rows, [3000] * 2, fuse="auto"), slo, model)
    assert not too_long.fuse and too_long.prefill_sms is not None


def test_a_queue_that_one_prompt_a_step_would_keep_past_ttft_goes_to_the_split():
    """Served beside decode the MoE's prefill ran ~1.4x its calibration (thirty-fourth round), and
    then fused steps outpace the split at any queue; but a fused step holds one ~1000-token
    prompt beside 240 rows, so twenty waiting at once would take ~540 ms to drain, past the TTFT
    plan's 500, and the split's fuller batch takes them; twelve drain within it and ride."""
    model, slo = h200_w8a8_model(), MOE_SLO
    model.correction["prefill"] = 1.4
    one_step = model.fused_ms(240, 240 * 1300, PrefillShape.of([1000]), 132)
    assert 12 * one_step < slo.ttft_ms * slo.ttft_plan < 20 * one_step
    twelve = bullet_policy(moe_state(240, [1000] * 12, fuse="auto", max_prefill_seqs=32), slo, model)
    assert twelve.fuse and twelve.admit == [0]
    twenty = bullet_policy(moe_state(240, [1000] * 20, fuse="auto", max_prefill_seqs=32), slo, model)
    assert not twenty.fuse and twenty.prefill_sms is not None and len(twenty.admit) == 8  # 8192 tokens' worth


def test_a_row_of_few_tokens_affords_a_shorter_step_than_a_long_one():
    """Each row spends its TPOT budget (50 ms a gap) on the gaps left: those beside a 250 ms
    prefill at the step asked about, the rest at the recent mean gap (20 ms here)."""
    import math

    from bullet_trt.spatial.row_pace import RowPace, affordable_step_ms, rows_step_ms

    def affords(row, later_ms=20.0, beside_ms=250.0, floor_ms=10.0):
        return affordable_step_ms(row, 50.0, floor_ms, later_ms, beside_ms)
    # just handed over, two tokens: one gap (the step in flight and its own), 50 ms in all,
    # less than the prefill lasts: both waits may fall beside it
    assert affords(RowPace(2, 1, 0.0)) == 25.0
    assert affords(RowPace(3, 1, 0.0)) == pytest.approx(100 / 3)
    # ten tokens: 450 ms of budget over ten waits, 200 ms at the later pace: 250 ms of slack
    # covers the prefill whatever decode's step beside it
    assert affords(RowPace(10, 1, 0.0)) == math.inf
    # ... but at a later pace of 30 ms its slack is 150 ms: the steps beside the prefill may
    # take 30 x 250 / (250 - 150) = 75 ms, and the row still averages 50
    assert affords(RowPace(10, 1, 0.0), later_ms=30.0) == pytest.approx(75.0)
    steps_beside = 250.0 / 75.0
    assert (250.0 + (10 - steps_beside) * 30.0) / 9 == pytest.approx(50.0)
    # a long row, fresh or ahead of pace, affords any step
    assert affords(RowPace(339, 1, 0.0)) == math.inf
    assert affords(RowPace(339, 100, 2.0)) == math.inf
    assert affords(RowPace(5, 5, 0.1)) is None  # no step left
    assert affords(RowPace(3, 2, 0.2)) is None  # 100 ms behind: not even whole-GPU steps save it
    rows = [RowPace(339, 100, 2.0), RowPace(3, 1, 0.0), RowPace(3, 2, 0.2)]
    assert rows_step_ms(rows, 50.0, 10.0, 20.0, 250.0) == pytest.approx(100 / 3)  # the lost row binds nothing
    assert rows_step_ms([RowPace(339, 1, 0.0), RowPace(3, 2, 0.2)], 50.0, 10.0, 20.0, 250.0) is None


def test_the_mean_gap_counts_steps_and_skips_idle_spells():
    from bullet_trt.spatial.row_pace import GapMeter
    meter = GapMeter(idle_s=1.0)
    meter.step_done(10.0)
    assert meter.mean_ms is None  # one step: no gap yet
    meter.step_done(10.02)
    assert meter.mean_ms == pytest.approx(20.0)
    meter.step_done(15.0)  # after 5 s without a step: an idle spell, not a gap
    assert meter.mean_ms == pytest.approx(20.0)
    for k in range(1, 400):  # steps 60 ms apart pull the mean there
        meter.step_done(15.0 + 0.06 * k)
    assert meter.mean_ms == pytest.approx(60.0, abs=0.1)


def test_a_short_row_keeps_decode_more_sms_beside_a_late_queue():
    """A late queue takes every SM that decode can spare within the plan; a decoding row of
    two tokens affords half the SLO a step, and decode keeps enough SMs to run within that."""
    plan = SloConfig(1000.0, 50.0, tpot_plan=1.0)
    alone = bullet_policy(state(waiting=LATE), plan, MODEL)
    short = bullet_policy(state(waiting=LATE, row_step_ms=25.0), plan, MODEL)
    assert short.prefill_sms < alone.prefill_sms
    assert short.predicted_decode_ms <= 25.0 < alone.predicted_decode_ms
    # rows that afford more than the plan change nothing
    assert bullet_policy(state(waiting=LATE, row_step_ms=80.0), plan, MODEL).prefill_sms == alone.prefill_sms


def test_a_gathering_batch_is_expected_when_its_hold_ends_or_sooner_at_the_pace_prompts_arrive():
    hold = dict(hold_ms=200.0, batch_tokens=1024, max_prefill_seqs=8)
    # one prompt: nothing tells the pace yet, so the hold's end
    assert gathering_ends_in_ms(state(waiting=((0.0, 100),), now=0.05, **hold)) == pytest.approx(150.0)
    # 800 tokens came 100 ms after the oldest: the 124 missing ones are due in 15.5 ms
    assert gathering_ends_in_ms(state(waiting=((0.0, 100), (0.09, 800)), now=0.1, **hold)) == pytest.approx(15.5)
    # one prompt short of the batch's count, at one prompt per 50 ms
    few = dict(hold, max_prefill_seqs=3)
    assert gathering_ends_in_ms(state(waiting=((0.0, 10), (0.02, 10)), now=0.05, **few)) == pytest.approx(50.0)
    assert gathering_ends_in_ms(state(waiting=((0.0, 100),), now=0.3, **hold)) == 0.0


def test_a_gathering_batch_moves_decode_ahead_only_once_it_is_due():
    """serve.split_ahead with its default lead of two decode steps: a batch whose hold has far
    to run leaves decode on the whole GPU (parked on the complement for whole holds, decode
    lost more than the shared SMs cost on an H200); near its expected start the decision names
    its split."""
    hold = dict(hold_ms=200.0, batch_tokens=3072, max_prefill_seqs=16, split_ahead=True)
    lead_ms = 2 * MODEL.decode_ms(32, 32 * 1024, 132)
    one = ((0.0, 150),)
    far = bullet_policy(state(waiting=one, now=0.2 - 2 * lead_ms / 1e3, **hold), SLO, MODEL)
    assert far.admit == [] and far.ahead_sms is None
    near = bullet_policy(state(waiting=one, now=0.2 - lead_ms / 2e3, **hold), SLO, MODEL)
    assert near.admit == [] and near.ahead_sms in SPLITS



def test_with_slices_the_prompt_that_does_not_fit_whole_fills_the_fused_steps_budget():
    """serve.fuse_prompt_slices: beside 240 rows a 2048-token step holds one ~1000-token prompt
    whole and 808 tokens of the next, as chunked's step would; without slices only the first
    rides. A head too long for any step rides in part too (`always`), where whole it would go
    to the partition."""
    model, slo = h200_w8a8_model(), MOE_SLO
    sliced = bullet_policy(moe_state(240, [1000] * 3, fuse="auto", fuse_slices=True), slo, model)
    assert sliced.fuse and sliced.admit == [0, 1] and sliced.tokens == [1000, 808]
    assert sliced.predicted_prefill_ms == model.fused_ms(240, 240 * 1300, PrefillShape.of([1000, 808]), 132)
    whole = bullet_policy(moe_state(240, [1000] * 3, fuse="auto"), slo, model)
    assert whole.admit == [0] and whole.tokens is None
    long_head = bullet_policy(moe_state(240, [3000, 100], fuse="always", fuse_slices=True), slo, model)
    assert long_head.fuse and long_head.admit == [0] and long_head.tokens == [1808]
    assert not bullet_policy(moe_state(240, [3000, 100], fuse="always"), slo, model).fuse


def test_a_sliced_prompts_rest_counts_in_the_fused_steps_ttft_drain():
    """Twenty ~1000-token prompts drain through sliced fused steps (1808 tokens a step) in
    twelve steps where whole ones take twenty: the guard sees the rest of each sliced prompt
    ride in the next step, and lets a queue fuse that whole prompts could not drain in time."""
    model, slo = h200_w8a8_model(), MOE_SLO
    one_whole = model.fused_ms(240, 240 * 1300, PrefillShape.of([1000]), 132)
    full = model.fused_ms(240, 240 * 1300, PrefillShape.of([1000, 808]), 132)
    queue = [1000] * 20
    assert 20 * one_whole > slo.ttft_ms * slo.ttft_plan > 12 * full  # 20 prompts: ~12 full steps
    assert not fused_steps_meet_ttft(moe_state(240, queue, fuse="auto"), slo, model)
    assert fused_steps_meet_ttft(moe_state(240, queue, fuse="auto", fuse_slices=True), slo, model)
