"""Decode's plan beside a prefill moves toward the SLO under more pressure (serve.tpot_plan_auto):
up when TTFT is nearer its SLO than TPOT is to its own, down the other way, held when both have
room or they are even, within bounds and at most once an interval."""
from __future__ import annotations

import pytest

from bullet_trt.spatial.plan_tuner import TpotPlanTuner

TTFT_SLO, TPOT_SLO = 1000.0, 40.0


def tuner(**kw) -> TpotPlanTuner:
    args = dict(ttft_slo_ms=TTFT_SLO, tpot_slo_ms=TPOT_SLO, start=1.0, min_requests=10, interval_s=1.0)
    args.update(kw)
    return TpotPlanTuner(**args)


def fill(t: TpotPlanTuner, ttft_share: float, tpot_share: float, n: int = 20) -> None:
    """n requests, every one at these shares of the two SLOs."""
    for _ in range(n):
        t.record_ttft(ttft_share * TTFT_SLO)
        t.record_tpot(tpot_share * TPOT_SLO)


def test_holds_until_both_signals_have_enough_requests():
    t = tuner()
    fill(t, 0.9, 0.3, n=9)
    assert t.pressures() is None and t.plan(0.0) == 1.0
    t.record_ttft(900.0)
    assert t.plan(0.0) == 1.0  # TPOT still has nine
    t.record_tpot(12.0)
    assert t.pressures() == pytest.approx((0.9, 0.3))
    assert t.plan(0.0) == pytest.approx(1.1)  # far apart: two steps


def test_ttft_under_pressure_raises_the_plan_at_most_once_an_interval_up_to_the_ceiling():
    t = tuner(ceiling=1.1)
    fill(t, 0.7, 0.5)  # 0.2 apart: one step
    assert t.plan(0.0) == pytest.approx(1.05)
    assert t.plan(0.5) == pytest.approx(1.05)  # within the interval of the last look
    assert t.plan(1.0) == pytest.approx(1.1)
    assert t.plan(2.0) == pytest.approx(1.1)


def test_tpot_under_pressure_lowers_the_plan_down_to_the_floor():
    """The sixth round's H100 edge at TPOT <= 40 ms: TPOT near its SLO, TTFT far from its own."""
    t = tuner(start=1.5, floor=1.3)
    fill(t, 0.3, 0.95)
    assert t.plan(0.0) == pytest.approx(1.4)
    assert t.plan(1.0) == pytest.approx(1.3)
    assert t.plan(2.0) == pytest.approx(1.3)


def test_a_backlog_raises_the_plan_before_its_requests_have_a_token():
    """What the TPOT-only tuner missed: TPOT near its SLO, but prompts waiting past theirs."""
    t = tuner(start=1.5)
    fill(t, 0.3, 0.95)
    assert t.plan(0.0, oldest_wait_ms=2500.0) == pytest.approx(1.6)
    assert t.pressures(oldest_wait_ms=2500.0) == pytest.approx((2.5, 0.95))


def test_holds_when_both_have_room_or_are_even():
    t = tuner(start=1.2)
    fill(t, 0.1, 0.55)  # far apart, but neither is busy
    assert t.plan(0.0) == 1.2
    t2 = tuner(start=1.2)
    fill(t2, 0.85, 0.95)  # both busy, within the band
    assert t2.plan(0.0) == 1.2 and t2.plan(5.0) == 1.2


def test_reads_the_quantile_of_the_recent_window_only():
    t = tuner(window=20, min_requests=20)
    fill(t, 0.9, 0.95)
    fill(t, 0.2, 0.95)  # the TTFT window now holds only these
    assert t.pressures() == pytest.approx((0.2, 0.95))
    # one slow first token in five keeps the 90th percentile at the slow ones
    t2 = tuner(min_requests=20)
    for i in range(20):
        t2.record_ttft(950.0 if i % 5 == 0 else 100.0)
        t2.record_tpot(20.0)
    assert t2.pressures()[0] == pytest.approx(0.95) and t2.plan(0.0) == pytest.approx(1.05)


def test_a_start_outside_the_bounds_is_refused():
    with pytest.raises(ValueError, match="outside"):
        tuner(start=0.5)
