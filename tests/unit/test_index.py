"""Unit tests of the shard's bookkeeping: allocator, LRU, capacity, leases, two-phase writes."""

import itertools
import random

import pytest

from ucm_ray.store.shard.allocator import ExtentAllocator
from ucm_ray.store.shard.index import BlockIndex


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


OWNER, OTHER = 11, 22


def put(idx, key, size, owner=OWNER):
    token, offs = idx.reserve(owner, size, 1)
    assert len(offs) == 1
    assert idx.commit(owner, token, [(key, offs[0], None)]) == [True]
    return offs[0]


def test_an_extent_keeps_its_sizes_alignment_whatever_its_neighbours():
    """A pool mixes entry sizes (attention blocks, mamba states, other models): an odd-sized
    extent must not leave every later 32 KiB block at a 64-byte offset, or a GPU step's gather
    plan falls to 64-byte rows (a 512 MiB step: 8M indices instead of 16k). Sizes that are not
    a multiple of 4 KiB still pack at 64 bytes."""
    a = ExtentAllocator(1 << 20, align=64)
    assert a.alloc(64 * 3) == 0  # a small state: packed at once
    block = a.alloc(32 << 10)
    assert block is not None and block % 4096 == 0
    assert a.alloc(64) == 64 * 3  # the gap before the block still serves small extents
    big = [a.alloc(96 << 10) for _ in range(4)]  # 96 KiB: a multiple of 32 KiB, aligned to 4 KiB
    assert all(off is not None and off % 4096 == 0 for off in big)
    for off, size in [(0, 64 * 3), (block, 32 << 10), (64 * 3, 64), *((off, 96 << 10) for off in big)]:
        a.free(off, size)
    assert a.free_bytes == a.capacity and a.largest_hole == a.capacity


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
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans))
        assert a.free_bytes == a.capacity - sum(a.rounded(s) for s in live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.largest_hole == a.capacity  # fully coalesced again
    with pytest.raises(ValueError):
        a.free(0, 64) or a.free(0, 64)


def test_reserved_is_invisible_until_commit():
    idx, _ = make()
    token, offs = idx.reserve(OWNER, 100, 1)
    assert len(offs) == 1
    assert idx.contains([k(1)]) == [False]
    assert idx.acquire(OWNER, [k(1)])[1] == [None]
    assert idx.commit(OWNER, token, [(k(1), offs[0], 7)]) == [True]
    assert idx.contains([k(1)]) == [True]
    assert idx.acquire(OWNER, [k(1)])[1][0].checksum == 7  # the checksum belongs to the entry


def test_anonymous_reserve_commit_and_free():
    idx, _ = make(capacity=64 * 4)
    token, offs = idx.reserve(OWNER, 64, 3)
    assert len(set(offs)) == 3 and idx.stats().pending_bytes == 192
    # one slot published, one freed, one left reserved
    assert idx.commit(OWNER, token, [(k(1), offs[0], None)], free_offsets=[offs[1]]) == [True]
    assert idx.stats().pending_bytes == 64 and idx.stats().used_bytes == 64
    # a freed or committed slot cannot be committed (again)
    assert idx.commit(OWNER, token, [(k(2), offs[1], None), (k(3), offs[0], None)]) == [False, False]
    assert idx.commit(OWNER, token, [(k(2), offs[2], None)]) == [True]
    assert idx.stats().pending_bytes == 0
    idx.acquire(OWNER, [k(1), k(2)])  # pinned: not evictable
    assert len(idx.reserve(OWNER, 64, 3)[1]) == 2  # room for two more, the third is dropped
    assert idx.stats().dropped_saves == 1


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


def test_acquire_counts_lookups_and_hits():
    idx, _ = make()
    put(idx, k(1), 64)
    idx.acquire(OWNER, [k(1), k(2), k(3)])
    s = idx.stats()
    assert (s.lookups, s.hits) == (3, 1)


def test_pinned_entries_survive_eviction_until_lease_expires():
    idx, clock = make(capacity=64 * 2, lease_s=5.0)
    put(idx, k(1), 64)
    put(idx, k(2), 64)
    lease, slots = idx.acquire(OWNER, [k(1), k(2)])
    assert all(slots) and idx.stats().pins == 2
    assert idx.reserve(OWNER, 64, 1)[1] == [] and idx.stats().dropped_saves == 1  # no room: dropped
    clock.t = 6.0  # the reader vanished: its pins lapse
    assert len(idx.reserve(OWNER, 64, 1)[1]) == 1 and idx.stats().pins == 0
    assert idx.release(OWNER, [lease]) == [False]  # the reader must distrust what it copied


def test_release_in_time_reports_valid_and_only_once():
    idx, _ = make()
    put(idx, k(1), 64)
    lease, _ = idx.acquire(OWNER, [k(1)])
    assert idx.stats().pins == 1
    assert idx.release(OWNER, [lease]) == [True]
    assert idx.release(OWNER, [lease]) == [False]  # no longer held
    assert idx.stats().pins == 0


def test_ids_are_random_63_bit():
    idx, _ = make(capacity=64 * 64)
    put(idx, k(1), 64)
    leases = [idx.acquire(OWNER, [k(1)])[0] for _ in range(20)]
    tokens = [idx.reserve(OWNER, 64, 1)[0] for _ in range(20)]
    ids = leases + tokens
    assert len(set(ids)) == 40 and all(0 < i < 2 ** 63 for i in ids)
    assert sorted(leases) != leases or sorted(tokens) != tokens  # not counters
    other, _ = make()
    put(other, k(1), 64)
    assert other.acquire(OWNER, [k(1)])[0] not in leases  # a new index (shard start) never repeats ids


def test_release_by_another_owner_does_not_unpin():
    idx, _ = make(capacity=64, lease_s=5.0)
    put(idx, k(1), 64)
    lease, _ = idx.acquire(OWNER, [k(1)])
    assert idx.release(OTHER, [lease]) == [False]  # someone else's lease: no effect
    assert idx.reserve(OWNER, 64, 1)[1] == []  # still pinned: not evicted
    assert idx.release(OWNER, [lease]) == [True]  # the owner still holds it
    assert len(idx.reserve(OWNER, 64, 1)[1]) == 1


def test_commit_and_renew_by_another_owner_have_no_effect():
    idx, clock = make(reserve_s=2.0)
    token, offs = idx.reserve(OWNER, 64, 1)
    assert idx.renew(OTHER, [token]) == [False]
    assert idx.commit(OTHER, token, [(k(1), offs[0], None)]) == [False]
    assert idx.contains([k(1)]) == [False]
    clock.t = 1.5
    assert idx.renew(OWNER, [token]) == [True]  # extends to t=3.5
    clock.t = 3.0
    assert idx.commit(OWNER, token, [(k(1), offs[0], None)]) == [True]


def test_concurrent_writers_first_commit_wins_and_no_slot_leaks():
    idx, _ = make(capacity=64 * 4)
    t1, o1 = idx.reserve(OWNER, 64, 1)
    t2, o2 = idx.reserve(OTHER, 64, 1)
    assert o1[0] != o2[0]  # each writer has its own slot: no torn block is possible
    assert idx.commit(OTHER, t2, [(k(1), o2[0], None)]) == [True]
    assert idx.commit(OWNER, t1, [(k(1), o1[0], None)]) == [False]
    _, slots = idx.acquire(OWNER, [k(1)])
    assert slots[0].offset == o2[0]
    assert idx.stats().used_bytes == 64 and idx.stats().duplicate_commits == 1
    assert idx.stats().pending_bytes == 0


def test_expired_reservation_is_quarantined_before_its_slots_are_reused():
    idx, clock = make(capacity=64, reserve_s=2.0)
    token, offs = idx.reserve(OWNER, 64, 1)
    clock.t = 3.0  # expired: the slow writer may still be copying into the slot
    assert idx.reserve(OTHER, 64, 1)[1] == []  # so nobody else gets it yet
    assert idx.stats().quarantined_bytes == 64 and idx.stats().expired_reservations == 1
    assert idx.renew(OWNER, [token]) == [False]  # too late to renew
    assert idx.commit(OWNER, token, [(k(1), offs[0], None)]) == [False]  # nor to commit
    clock.t = 5.5  # quarantine ends 2 s after the expiry was noticed (at 3)
    t2, o2 = idx.reserve(OTHER, 64, 1)
    assert o2 == offs  # only now is the space reused
    assert idx.commit(OWNER, token, [(k(1), offs[0], None)]) == [False]
    assert idx.commit(OTHER, t2, [(k(1), o2[0], None)]) == [True]
    assert idx.stats().quarantined_bytes == 0


def test_quarantine_counts_from_when_the_expiry_is_noticed():
    """A shard paused far past a grant's deadline must still hold the slots a full timeout after it
    wakes: the paused writer's copy may land right then."""
    idx, clock = make(capacity=64, reserve_s=2.0)
    idx.reserve(OWNER, 64, 1)
    clock.t = 100.0  # the shard was stopped for a long time
    assert idx.reserve(OTHER, 64, 1)[1] == []
    clock.t = 101.9
    assert idx.reserve(OTHER, 64, 1)[1] == []
    clock.t = 102.1
    assert idx.reserve(OTHER, 64, 1)[1] != []


def test_remove_unpinned_frees_at_once():
    idx, _ = make(capacity=64)
    off = put(idx, k(1), 64)
    assert idx.remove([(k(1), off + 64)]) == 0  # not that entry's slot: kept
    assert idx.remove([(k(1), off)]) == 1
    assert idx.contains([k(1)]) == [False]
    assert idx.stats().used_bytes == 0 and idx.stats().removals == 1
    assert len(idx.reserve(OWNER, 64, 1)[1]) == 1


def test_remove_while_pinned_unlists_now_frees_on_last_release():
    idx, _ = make(capacity=64)
    off = put(idx, k(1), 64)
    l1, _ = idx.acquire(OWNER, [k(1), k(1)])
    l2, _ = idx.acquire(OTHER, [k(1)])
    assert idx.remove([(k(1), off)]) == 1
    assert idx.acquire(OWNER, [k(1)])[1] == [None]  # invisible at once
    assert idx.reserve(OWNER, 64, 1)[1] == []  # but its slot is still being read
    assert idx.release(OWNER, [l1]) == [True]
    assert idx.reserve(OWNER, 64, 1)[1] == []
    assert idx.release(OTHER, [l2]) == [True]  # last pin gone: freed (exactly once)
    assert len(idx.reserve(OWNER, 64, 1)[1]) == 1
    assert idx.stats().used_bytes == 0


def test_oversized_and_bad_sizes():
    idx, _ = make(capacity=128)
    assert idx.reserve(OWNER, 1000, 1)[1] == []
    with pytest.raises(ValueError):
        idx.reserve(OWNER, 0, 1)


def test_eviction_takes_a_prefix_tail_first():
    """Blocks are committed and looked up head first; a prefix without its head is worthless,
    so when room is needed its tail goes first (before: the head, in commit order)."""
    idx, _ = make(capacity=64 * 4)
    token, offs = idx.reserve(OWNER, 64, 4)
    assert idx.commit(OWNER, token, [(k(i), off, None) for i, off in enumerate(offs)]) == [True] * 4
    put(idx, k(9), 64)  # needs room: one of the prefix goes
    assert idx.contains([k(i) for i in range(4)]) == [True, True, True, False]
    lease, _ = idx.acquire(OWNER, [k(0), k(1), k(2)])  # a lookup touches head first as well
    idx.release(OWNER, [lease])
    put(idx, k(10), 64)  # evicts k(9), the least recently used, not the prefix
    put(idx, k(11), 64)  # then the prefix's tail
    assert idx.contains([k(0), k(1), k(2), k(9), k(10), k(11)]) == [True, True, False, False, True, True]
