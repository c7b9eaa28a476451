"""A worker hands its idle cached GPU memory back between steps once it has grown by the limit
past what the last release (or the start) left, and only then."""
from __future__ import annotations

import torch

from bullet_trt.engine.idle_cache import IdleCacheRelease

MIB = 2**20


class FakeAllocator:
    """Reserved and allocated bytes as a caching allocator books them; `releasable` is the part
    of the idle cache that empty_cache can hand back (not a graph pool's)."""

    def __init__(self, reserved: int, allocated: int):
        self.reserved, self.allocated = reserved, allocated
        self.pinned_idle = reserved - allocated  # idle at start: graph pools, say
        self.releases = 0

    def stats(self) -> tuple[int, int]:
        return self.reserved, self.allocated

    def cache(self, mib: int) -> None:
        self.reserved += mib * MIB  # a step's blocks, freed into the cache at its end

    def release(self) -> None:
        self.releases += 1
        self.reserved = self.allocated + self.pinned_idle


def test_releases_once_the_idle_cache_has_grown_by_the_limit(capsys):
    alloc = FakeAllocator(reserved=6000 * MIB, allocated=4000 * MIB)  # 2000 MiB idle at start
    trim = IdleCacheRelease("prefill", alloc.stats, alloc.release, limit_bytes=512 * MIB)
    alloc.cache(300)
    assert not trim.after_step() and alloc.releases == 0  # 300 MiB past the start's idle
    alloc.cache(300)
    assert trim.after_step() and alloc.releases == 1
    assert alloc.reserved == 6000 * MIB  # back to what start held: the start's idle is not counted
    assert "prefill worker returned 0.59 GiB of idle cached GPU memory" in capsys.readouterr().err
    alloc.cache(511)
    assert not trim.after_step()


def test_what_a_release_cannot_hand_back_becomes_the_new_floor():
    alloc = FakeAllocator(reserved=1000 * MIB, allocated=1000 * MIB)
    trim = IdleCacheRelease("decode", alloc.stats, alloc.release, limit_bytes=256 * MIB)
    alloc.cache(300)
    alloc.pinned_idle = 200 * MIB  # of the 300, 200 stay (a pool the release may not touch)
    assert trim.after_step() and trim.floor == 200 * MIB
    alloc.cache(200)  # 300 idle past a floor of 200: under the limit, no release every step
    assert not trim.after_step() and alloc.releases == 1


def test_logs_the_first_release_and_then_at_powers_of_two(capsys):
    alloc = FakeAllocator(reserved=0, allocated=0)
    trim = IdleCacheRelease("prefill", alloc.stats, alloc.release, limit_bytes=1 * MIB)
    for _ in range(5):
        alloc.cache(2)
        assert trim.after_step()
    lines = [l for l in capsys.readouterr().err.splitlines() if "returned" in l]
    assert [l.split("(release ")[1].split(")")[0] for l in lines] == ["1", "2", "4"]


def test_nothing_to_release_on_cpu():
    assert IdleCacheRelease.for_device("prefill", torch.device("cpu")) is None
