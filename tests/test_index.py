"""Unit tests of the shard's bookkeeping: allocator, LRU, capacity, leases, two-phase writes."""

import random

import pytest

from ucm_ray.store.allocator import ExtentAllocator
from ucm_ray.store.index import BlockIndex


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(capacity=1024, lease_s=10.0, reserve_s=10.0):
    clock = Clock()
    return BlockIndex(capacity, lease_s=lease_s, reserve_timeout_s=reserve_s, align=64, clock=clock), clock


def put(idx, key, size):
    token, offs = idx.reserve([(key, size)])
    assert offs[0] is not None
    assert idx.commit(token, [key]) == [True]
    return offs[0]


def test_allocator_coalesces_and_never_overlaps():
    a = ExtentAllocator(64 * 100, align=64)
    rng = random.Random(0)
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 640)
            off = a.alloc(size)
            if off is not None:
                live[off] = size
        spans = sorted((o, o + a.rounded(s)) for o, s in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert a.free_bytes == a.capacity - sum(a.rounded(s) for s in live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.largest_hole == a.capacity  # fully coalesced again
    with pytest.raises(ValueError):
        a.free(0, 64) or a.free(0, 64)


def test_reserved_is_invisible_until_commit():
    idx, _ = make()
    token, offs = idx.reserve([(k(1), 100)])
    assert offs[0] is not None
    assert idx.contains([k(1)]) == [False]
    assert idx.acquire([k(1)])[1] == [None]
    assert idx.commit(token, [k(1)]) == [True]
    assert idx.contains([k(1)]) == [True]


def test_abort_frees_and_never_publishes():
    idx, _ = make(capacity=128)
    token, offs = idx.reserve([(k(1), 128)])
    idx.abort(token, [k(1)])
    assert idx.commit(token, [k(1)]) == [False]
    assert idx.contains([k(1)]) == [False]
    assert idx.stats().used_bytes == 0
    assert idx.reserve([(k(2), 128)])[1][0] is not None  # the space came back


def test_lru_eviction_is_byte_accurate():
    idx, _ = make(capacity=64 * 10)
    for i in range(10):
        put(idx, k(i), 64)
    idx.contains([k(0)])  # touch: 0 becomes most recent
    put(idx, k(10), 128)  # needs two slots: evicts 1 and 2
    present = idx.contains([k(i) for i in range(11)])
    assert present == [True, False, False] + [True] * 8
    s = idx.stats()
    assert s.used_bytes == 64 * 8 + 128 == s.capacity_bytes
    assert s.evictions == 2 and s.evicted_bytes == 128


def test_pinned_entries_survive_eviction_until_lease_expires():
    idx, clock = make(capacity=64 * 2, lease_s=5.0)
    put(idx, k(1), 64)
    put(idx, k(2), 64)
    lease, slots = idx.acquire([k(1), k(2)])
    assert all(slots)
    token, offs = idx.reserve([(k(3), 64)])
    assert offs == [None] and idx.stats().dropped_saves == 1  # no room: dropped, counted
    clock.t = 6.0  # the reader vanished: its pins lapse
    token, offs = idx.reserve([(k(3), 64)])
    assert offs[0] is not None
    assert idx.release(lease) is False  # the reader must distrust what it copied


def test_release_in_time_reports_valid():
    idx, _ = make()
    put(idx, k(1), 64)
    lease, _ = idx.acquire([k(1)])
    assert idx.release(lease) is True
    assert idx.release(lease) is False  # unknown lease


def test_concurrent_writers_first_commit_wins_and_no_slot_leaks():
    idx, _ = make(capacity=64 * 4)
    t1, o1 = idx.reserve([(k(1), 64)])
    t2, o2 = idx.reserve([(k(1), 64)])
    assert o1[0] != o2[0]  # each writer has its own slot: no torn block is possible
    assert idx.commit(t2, [k(1)]) == [True]
    assert idx.commit(t1, [k(1)]) == [False]
    lease, slots = idx.acquire([k(1)])
    assert slots[0].offset == o2[0]
    assert idx.stats().used_bytes == 64 and idx.stats().duplicate_commits == 1


def test_stale_reservation_is_reclaimed():
    idx, clock = make(capacity=64, reserve_s=2.0)
    token, offs = idx.reserve([(k(1), 64)])
    clock.t = 3.0
    assert idx.reserve([(k(2), 64)])[1][0] is not None  # space reclaimed from the dead writer
    assert idx.commit(token, [k(1)]) == [False]  # the late writer's commit is refused
    assert idx.stats().expired_reservations == 1


def test_oversized_and_bad_sizes():
    idx, _ = make(capacity=128)
    assert idx.reserve([(k(1), 1000)])[1] == [None]
    with pytest.raises(ValueError):
        idx.reserve([(k(1), 0)])


def test_existing_key_is_not_rewritten():
    idx, _ = make()
    put(idx, k(1), 64)
    assert idx.reserve([(k(1), 64)])[1] == [None]
