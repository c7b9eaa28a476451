"""The response threads of the Triton model (bullet_trt/serving/triton/delivery.py) and the
cancellation poll's turns, as real threads."""
from __future__ import annotations

import threading

import pytest

from bullet_trt.serving.triton.delivery import Delivery
from bullet_trt.serving.triton.model import next_turn
from tests.polling import wait_for


def test_one_shards_items_leave_in_order_and_a_slow_shard_does_not_hold_the_others():
    seen: list[tuple[int, int]] = []
    release = threading.Event()

    def deliver(item):
        shard, n = item
        if shard == 0 and n == 0:
            release.wait(10)  # a send that waits on Triton's side
        seen.append(item)

    delivery = Delivery(2, deliver)
    for n in range(5):
        delivery.put(0, (0, n))
        delivery.put(1, (1, n))
    wait_for(lambda: len(seen) >= 5, what="shard 1's five items", timeout=10)
    assert seen == [(1, n) for n in range(5)]  # shard 1 went on while shard 0 waited
    release.set()
    delivery.close()
    assert [item for item in seen if item[0] == 0] == [(0, n) for n in range(5)]


def test_close_delivers_what_was_queued_and_a_failing_item_stops_nothing():
    seen = []

    def deliver(item):
        if item == "bad":
            raise RuntimeError("client went away")
        seen.append(item)

    delivery = Delivery(3, deliver)
    for shard, item in enumerate(["a", "bad", "b", "c", "d"]):
        delivery.put(shard, item)
    delivery.close()
    assert sorted(seen) == ["a", "b", "c", "d"]


def test_wait_idle_returns_once_every_item_put_has_left():
    """What the model's self-unload waits for after its engine died: the error finals of the
    requests it had in flight written to their streams (docs/serving.md, Health)."""
    release = threading.Event()
    seen = []

    def deliver(item):
        if item == "slow":
            release.wait(10)
        if item == "bad":
            raise RuntimeError("client went away")
        seen.append(item)

    delivery = Delivery(2, deliver)
    assert delivery.wait_idle(0.0)  # nothing put yet
    for shard, item in enumerate(["slow", "a", "bad", "b"]):
        delivery.put(shard, item)
    wait_for(lambda: "b" in seen, what="shard 1's items", timeout=10)
    assert not delivery.wait_idle(0.05)  # shard 0 still holds "slow", and "bad" behind it
    release.set()
    assert delivery.wait_idle(10)
    assert sorted(seen) == ["a", "b", "slow"]  # the failing item counts as gone too
    delivery.close()


def test_no_response_thread_is_refused_by_name():
    with pytest.raises(ValueError, match="response_threads must be at least 1, got 0"):
        Delivery(0, print)


def test_the_cancellation_poll_checks_every_request_in_turn():
    active = list("abcde")
    turn, checked = next_turn(active, 0, 2)
    assert turn == ["a", "b"]
    turn, checked = next_turn(active, checked, 2)
    assert turn == ["c", "d"]
    turn, checked = next_turn(active, checked, 2)
    assert turn == ["e", "a"]  # round from the end to the start
    assert next_turn(active, checked, 10)[0] == ["b", "c", "d", "e", "a"]  # never one twice a poll
    assert next_turn(["x"], 7, 3) == (["x"], 1)
    assert next_turn([], 4, 3) == ([], 4)
