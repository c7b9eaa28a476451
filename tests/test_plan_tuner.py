"""Decode's plan beside a prefill follows the TPOT that finished requests got
(serve.tpot_plan_auto): up while it has room, down faster when near the SLO, within bounds."""
from __future__ import annotations

import pytest

from bullet_trt.spatial.plan_tuner import TpotPlanTuner


def tuner(**kw) -> TpotPlanTuner:
    args = dict(tpot_slo_ms=40.0, start=0.85, min_requests=10, interval_s=1.0)
    args.update(kw)
    return TpotPlanTuner(**args)


def test_holds_until_enough_requests_have_ended():
    t = tuner()
    for _ in range(9):
        t.record(10.0)
    assert t.plan(100.0) == 0.85
    t.record(10.0)
    assert t.plan(100.0) == pytest.approx(0.90)


def test_rises_with_room_at_most_once_an_interval_up_to_the_ceiling():
    t = tuner(ceiling=1.0)
    for _ in range(20):
        t.record(20.0)  # 0.5 of the SLO
    assert t.plan(0.0) == pytest.approx(0.90)
    assert t.plan(0.5) == pytest.approx(0.90)  # within the interval of the last move
    assert t.plan(1.0) == pytest.approx(0.95)
    assert t.plan(2.0) == pytest.approx(1.0)
    assert t.plan(3.0) == pytest.approx(1.0)


def test_falls_twice_as_fast_near_the_slo_down_to_the_floor():
    t = tuner(start=1.5, floor=1.3)
    for _ in range(20):
        t.record(38.0)  # 0.95 of the SLO
    assert t.plan(0.0) == pytest.approx(1.4)
    assert t.plan(1.0) == pytest.approx(1.3)
    assert t.plan(2.0) == pytest.approx(1.3)


def test_holds_in_the_dead_band():
    t = tuner(start=1.2)
    for _ in range(20):
        t.record(34.0)  # 0.85 of the SLO: between low (0.8) and high (0.9)
    assert t.plan(0.0) == 1.2 and t.plan(5.0) == 1.2


def test_reads_the_quantile_of_the_recent_window_only():
    t = tuner(window=20, min_requests=20)
    for _ in range(20):
        t.record(39.0)
    for _ in range(20):
        t.record(12.0)  # the window now holds only these
    assert t.recent_quantile() == 12.0
    # one slow request in ten keeps the 90th percentile at the slow ones
    t2 = tuner(min_requests=20)
    for i in range(20):
        t2.record(39.0 if i % 5 == 0 else 12.0)
    assert t2.recent_quantile() == 39.0 and t2.plan(0.0) == pytest.approx(0.75)


def test_a_start_outside_the_bounds_is_refused():
    with pytest.raises(ValueError, match="outside"):
        tuner(start=0.5)
