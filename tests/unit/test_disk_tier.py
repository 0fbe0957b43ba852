"""The disk tier behind a real ``BlockIndex`` and a pool (an anonymous mapping, as the shard's
segment is): demotion ahead of eviction, eviction of clean entries first, promotion on a hit,
write-through, and the disk's own evictions handed back to the index. No Ray: the shard's
wiring is the next step."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import threading
import time

import pytest
import torch

from ucm_ray.store.engine.published_reader import IndexReader
from ucm_ray.store.shard.disk import DiskStore, FileOps
from ucm_ray.store.shard.disk import store as store_module
from ucm_ray.store.shard.disk import tier as tier_module
from ucm_ray.store.shard.disk.store import READ_DEPTH, shard_dir
from ucm_ray.store.shard.disk.tier import DiskTier
from ucm_ray.store.shard.index import BlockIndex
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.testing.clock import AdvancingClock

SLOT = 8192
WRITER, READER = 11, 22


def key(i: int) -> bytes:
    return b"blk-%d" % i


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


class Shard:
    """What the shard actor holds, without the actor: a pool, its index, a lock, a disk tier."""

    def __init__(self, root: str, pool_slots: int, disk_slots: int, *, prefer_clean: bool = True,
                 **tier_args) -> None:
        self.mapping = mmap.mmap(-1, pool_slots * SLOT)
        self.pool = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.index = BlockIndex(pool_slots * SLOT, lease_s=60, reserve_timeout_s=60, prefer_clean=prefer_clean)
        self.lock = threading.Lock()
        self.disk = DiskStore([root], "s0", disk_slots * SLOT)
        self.tier = DiskTier(self.index, self.pool, self.disk, self.lock, **tier_args)

    def write(self, i: int) -> None:
        with self.lock:
            token, offs = self.index.reserve(WRITER, SLOT, 1)
            assert offs, "no room in the pool"
            self.pool[offs[0]:offs[0] + SLOT] = payload(i)
            assert self.index.commit(WRITER, token, [(key(i), offs[0], None)]) == [True]

    def read(self, i: int) -> torch.Tensor | None:
        with self.lock:
            lease, slots = self.index.acquire(READER, [key(i)])
            slot = slots[0]
            out = None if slot is None else self.pool[slot.offset:slot.offset + slot.size].clone()
            self.index.release(READER, [lease])
        return out

    def offset_of(self, i: int) -> int:
        with self.lock:
            lease, slots = self.index.acquire(READER, [key(i)])
            self.index.release(READER, [lease])
        assert slots[0] is not None
        return slots[0].offset

    def demote_all(self) -> int:
        """What the shard's demotion thread does after a commit: batches until none is owed."""
        return self.tier.demote()

    def in_pool(self, *ids: int) -> list[bool]:
        with self.lock:
            return self.index.contains([key(i) for i in ids])


def test_eviction_takes_a_clean_entry_before_a_colder_dirty_one(tmp_path):
    s = Shard(str(tmp_path), 4, 16)
    for i in range(4):
        s.write(i)
    s.index.mark_clean([(key(2), s.offset_of(2))])
    s.write(4)
    assert s.in_pool(0, 1, 2, 3, 4) == [True, True, False, True, True]
    assert s.index.stats().evicted_dirty == 0


def test_without_a_disk_tier_eviction_is_plain_lru(tmp_path):
    s = Shard(str(tmp_path), 4, 16, prefer_clean=False)
    for i in range(4):
        s.write(i)
    s.index.mark_clean([(key(2), s.offset_of(2))])
    s.write(4)
    assert s.in_pool(0, 1, 2, 3, 4)[0] is False


def test_demotion_starts_above_the_high_watermark_and_cleans_the_cold_end(tmp_path):
    s = Shard(str(tmp_path), 8, 64, high=0.5, low=0.25)
    for i in range(4):
        s.write(i)
    assert s.demote_all() == 0  # 4 of 8 slots used: not above the high watermark
    for i in range(4, 6):
        s.write(i)
    assert s.demote_all() == 4 * SLOT  # used 6, low 2: the 4 coldest go to disk
    assert s.tier.on_disk([key(i) for i in range(6)]) == [True] * 4 + [False] * 2
    assert s.demote_all() == 0  # the cold end is clean already


def test_a_pool_evicting_below_its_high_watermark_gets_its_cold_end_demoted(tmp_path):
    """Entries of mixed sizes fragment a pool: a save can find no hole large enough while the
    pool's used bytes are under the high watermark. Such a pool is full in effect: once it has
    evicted, demotion cleans its cold end as it would a full pool's, so the next save evicts
    clean entries (CI lost the last-written keys of ``test_disk_tier_store`` this way: after
    the pool dropped under its watermark, nothing was demoted and every eviction was dirty)."""
    s = Shard(str(tmp_path), 8, 64, low=0.75)  # 8 slots of 8 KiB; high 0.9 (7.2 slots), low 0.75 (6)
    for i in range(7):
        s.write(i)
    assert s.demote_all() == 0  # 7 of 8 slots: under the high watermark, nothing is cold yet

    def save_double(i: int) -> None:  # one 16 KiB entry: no hole fits it, the pool evicts
        with s.lock:
            token, offs = s.index.reserve(WRITER, 2 * SLOT, 1)
            assert offs, "no room in the pool"
            s.pool[offs[0]:offs[0] + 2 * SLOT] = torch.cat([payload(i), payload(i)])
            assert s.index.commit(WRITER, token, [(key(i), offs[0], None)]) == [True]

    save_double(100)  # evicts 0 and 1, both dirty: nothing warned demotion (the cost of a first eviction)
    assert s.index.stats().evicted_dirty == 2 and s.in_pool(0, 1) == [False, False]  # (a hit would touch)
    assert s.index.stats().used_bytes <= 0.9 * 8 * SLOT  # 7 slots used again: under the watermark
    assert s.tier.behind()  # ...but evicting: its cold end (2 slots) is owed to disk
    assert s.demote_all() == 2 * SLOT
    assert s.tier.on_disk([key(2), key(3), key(4)]) == [True, True, False] and not s.tier.behind()
    save_double(101)  # evicts 2 and 3 again, clean now: nothing is lost
    assert s.index.stats().evicted_dirty == 2
    assert s.tier.promote([key(2), key(3)]) == [True, True]


@pytest.mark.parametrize("disk_slots, clean_slots", [(20, 8), (32, 8), (63, 8), (64, 16), (160, 16)])
def test_a_larger_disk_keeps_more_of_the_pool_clean_so_a_long_prompt_evicts_nothing_dirty(tmp_path, disk_slots,
                                                                                          clean_slots):
    """Writer-local placement brings a whole long prompt back into one pool (a promotion) or
    writes one there (its save), up to ~40 % of a pool; a quarter kept clean then evicts dirty
    entries, lost for good. A disk twice the pool or larger keeps half of it clean (its copies a
    quarter of the disk at most); a smaller one a quarter, as before. 32-slot pool, demotion caught
    up, then ``clean_slots`` new entries: none evicts a dirty one; one more than the clean share
    does."""
    s = Shard(str(tmp_path), 32, disk_slots)
    for i in range(32):
        s.write(i)
    s.demote_all()
    on_disk = sum(s.tier.on_disk([key(i) for i in range(32)]))
    assert on_disk == clean_slots
    for i in range(100, 100 + clean_slots):
        s.write(i)
    assert s.index.stats().evicted_dirty == 0
    s.write(999)
    assert s.index.stats().evicted_dirty == 1


def test_a_store_holding_10x_its_pool_serves_any_of_it(tmp_path):
    """The issue's 10x: eighty entries through a pool of eight, every one served in random order."""
    s = Shard(str(tmp_path), 8, 96)
    n = 80
    for i in range(n):
        s.write(i)
        s.demote_all()
    assert s.index.stats().evicted_dirty == 0 and s.index.stats().evictions >= n - 8
    assert all(s.tier.on_disk([key(i)])[0] or s.in_pool(i)[0] for i in range(n))
    order = list(range(n))
    random.Random(7).shuffle(order)
    for i in order:
        assert s.tier.promote([key(i)]) == [True], i
        got = s.read(i)
        assert got is not None and torch.equal(got, payload(i)), i
    assert s.tier.stats.promoted >= n - 8
    assert s.index.stats().evicted_dirty == 0  # promoted entries are clean: evicting them loses nothing


def test_without_demotion_evicted_entries_are_gone(tmp_path):
    s = Shard(str(tmp_path), 8, 64)
    for i in range(20):
        s.write(i)
    assert s.index.stats().evicted_dirty == 12
    assert s.tier.promote([key(0)]) == [False] and s.tier.stats.promote_misses == 1


def test_write_through_demotes_every_commit(tmp_path):
    s = Shard(str(tmp_path), 8, 64, write_through=True)
    for i in range(3):
        s.write(i)
    assert s.demote_all() == 3 * SLOT
    assert s.tier.on_disk([key(0), key(1), key(2)]) == [True] * 3


def test_a_flipped_byte_on_disk_is_not_promoted(tmp_path):
    s = Shard(str(tmp_path), 4, 16, write_through=True)
    s.write(0)
    s.demote_all()
    for i in range(1, 5):
        s.write(i)  # evicts 0 (clean)
    assert s.in_pool(0) == [False]
    path = os.path.join(shard_dir(str(tmp_path), "s0"), "data-0")
    with open(path, "r+b") as f:  # key 0 is the disk's first entry
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))
    assert s.tier.promote([key(0)]) == [False]
    st = s.index.stats()
    # the slot reserved for it (one entry was evicted for room) went back: nothing pending, nothing leaked
    assert s.in_pool(0) == [False] and st.pending_bytes == 0 and st.used_bytes == 3 * SLOT == 4 * SLOT - SLOT
    s.write(9)
    assert s.index.stats().evictions == st.evictions  # the freed slot took it
    assert s.disk.snapshot().corrupt == 1 and s.tier.on_disk([key(0)]) == [False]


def test_what_the_disk_evicts_is_dirty_again_in_the_pool(tmp_path):
    """A disk smaller than what it is asked to keep evicts; the pool's copies of those keys are
    then the only ones, so the pool's eviction must not take them as if they were on disk."""
    s = Shard(str(tmp_path), 4, 2, write_through=True)
    for i in range(2):
        s.write(i)
    s.demote_all()  # 0 and 1 on disk
    for i in range(2, 4):
        s.write(i)
    s.demote_all()  # the disk (2 slots) evicts what it held to take 2 and 3 (capped: no churn forever)
    assert sum(s.tier.on_disk([key(i) for i in range(4)])) == 2
    s.write(4)  # evicts an entry the disk holds, never one whose disk copy it evicted
    evicted = [i for i in range(4) if not s.in_pool(i)[0]]
    assert len(evicted) == 1 and s.index.stats().evicted_dirty == 0
    assert s.tier.promote([key(evicted[0])]) == [True] and torch.equal(s.read(evicted[0]), payload(evicted[0]))


def test_watermarks_are_checked():
    with pytest.raises(ValueError, match="watermarks"):
        DiskTier(BlockIndex(SLOT, lease_s=1, reserve_timeout_s=1), torch.empty(0), None,  # type: ignore[arg-type]
                 threading.Lock(), high=0.5, low=0.7)


class PublishedShard(Shard):
    """``Shard`` with the published index same-node readers look up, and 16-byte digest keys
    (the only keys that index lists)."""

    def __init__(self, root: str, pool_slots: int, disk_slots: int, index_file: str, **tier_args) -> None:
        self.published = PublishedIndex(index_file, pool_slots * SLOT, 1, disk_slots * SLOT)  # as the shard sizes it
        self.mapping = mmap.mmap(-1, pool_slots * SLOT)
        self.pool = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.index = BlockIndex(pool_slots * SLOT, lease_s=60, reserve_timeout_s=60, prefer_clean=True,
                                published=self.published)
        self.lock = threading.Lock()
        self.disk = DiskStore([root], "s0", disk_slots * SLOT, **tier_args.pop("store_args", {}))
        self.tier = DiskTier(self.index, self.pool, self.disk, self.lock, **tier_args)
        self.reader = IndexReader(index_file, 1)

    def lookup(self, *ids: int) -> list[str]:
        """What a same-node reader's published-index lookup says per key: hit, miss, or ask."""
        found = self.reader.lookup([key(i) for i in ids])
        assert found is not None
        return ["hit" if g else ("miss" if k else "ask") for g, k in zip(found.generation, found.known)]


def digest_keys(monkeypatch) -> None:
    """Keys the published index lists (``key`` is looked up at call time by every helper)."""
    monkeypatch.setitem(globals(), "key", lambda i: hashlib.blake2b(b"%d" % i, digest_size=16).digest())


def test_a_key_evicted_to_disk_is_listed_as_ask_the_shard_and_promotion_makes_it_a_hit(tmp_path, index_file,
                                                                                       monkeypatch):
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 4, 16, index_file, write_through=True)
    for i in range(4):
        s.write(i)
    s.demote_all()
    for i in range(4, 6):
        s.write(i)  # evicts 0 and 1 (clean): the disk holds them
    assert s.lookup(0, 1, 2, 3, 4, 5, 6) == ["ask", "ask", "hit", "hit", "hit", "hit", "miss"]
    assert s.reader.generation_of(key(0)) is None  # the one-key probe cannot say either
    # a reader told "ask" calls the shard's acquire: promoted, pinned, the bytes exact
    out, lease, _ = s.tier.promote_pinned([key(0), key(1)])
    s.tier.unpin(lease)
    assert out == [True, True] and s.lookup(0, 1) == ["hit", "hit"]
    assert torch.equal(s.read(0), payload(0)) and torch.equal(s.read(1), payload(1))


def test_the_published_table_stays_complete_with_the_disk_holding_many_pools(tmp_path, index_file, monkeypatch):
    """A table sized for the pool alone fills with the disk's keys and stops answering misses
    (every lookup of an absent key then asks the shard); sized for pool and disk, it lists all."""
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 16, 2048, index_file, write_through=True)
    written = 1000  # past a pool-sized table's load bound (512 of 1024 buckets)
    for i in range(written):
        s.write(i)
        s.demote_all()
    assert s.published.complete
    answers = s.lookup(*range(written + 8))
    assert answers[written:] == ["miss"] * 8  # absent: answered here, no call to the shard
    assert answers[:written - 16].count("ask") == written - 16 and answers[written - 16:written] == ["hit"] * 16


def test_what_the_disk_drops_is_unlisted_and_a_restart_lists_what_it_adopts(tmp_path, index_file, monkeypatch):
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 2, 2, index_file, write_through=True)
    for i in range(2):
        s.write(i)
    s.demote_all()
    for i in range(2, 4):
        s.write(i)  # evicts 0 and 1, clean
    assert s.lookup(0, 1) == ["ask", "ask"]
    s.demote_all()  # 2 and 3 to a 2-slot disk: it drops 0 and 1, now in neither tier
    assert s.lookup(0, 1, 2, 3) == ["miss", "miss", "hit", "hit"]
    s.tier.close()
    s.published.close()
    restarted = PublishedShard(str(tmp_path), 2, 2, index_file)  # the pool is empty, the disk adopted
    assert restarted.lookup(0, 1, 2, 3) == ["miss", "miss", "ask", "ask"]
    out, lease, _ = restarted.tier.promote_pinned([key(2), key(3)])
    assert out == [True, True] and torch.equal(restarted.read(3), payload(3))


class SlowReads(FileOps):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def preadv(self, fd, buffers, offset):
        time.sleep(self.delay_s)
        return super().preadv(fd, buffers, offset)


class ReadsOnClock(FileOps):
    """A disk whose every read takes ``delay_s`` of ``clock``: advanced as the read ends, not
    slept (with the clock frozen, only reads move it: a promotion's deadline passes when its
    reads took that long, however slow the host)."""

    def __init__(self, clock: AdvancingClock, delay_s: float) -> None:
        self.clock = clock
        self.delay_s = delay_s

    def preadv(self, fd, buffers, offset):
        read = super().preadv(fd, buffers, offset)
        self.clock.advance(self.delay_s)
        return read


def test_promotion_stops_at_its_bound_and_the_rest_are_misses(tmp_path, index_file, monkeypatch):
    """Reads of 150 ms against a 100 ms bound: the first READ_DEPTH may start at once (at least
    the first does), none once one of them ended (the bound passed), so the call is back within
    the bound and one read; the head of the prompt is promoted. On the tier's frozen clock, not
    the host's: timed on the host, a reader thread the host left waiting 100 ms found the bound
    passed (none read, or run 0 late behind run 1 read: no head), and the call's time was
    asserted."""
    digest_keys(monkeypatch)
    monkeypatch.setattr(store_module, "COALESCE_BYTES", SLOT)  # a read per key: the bound counts reads
    clock = AdvancingClock()
    clock.freeze()
    s = PublishedShard(str(tmp_path), 8, 16, index_file, write_through=True, wait_s=0.1, clock=clock,
                       store_args={"ops": ReadsOnClock(clock, 0.15)})
    for i in range(8):
        s.write(i)
    s.demote_all()
    for i in range(8, 16):
        s.write(i)  # 0..7 now on disk only
    out, lease, _ = s.tier.promote_pinned([key(i) for i in range(8)])
    s.tier.unpin(lease)
    done = out.count(True)
    assert 1 <= done <= READ_DEPTH and out == [True] * done + [False] * (8 - done), out
    assert s.tier.stats.promote_late == 8 - done
    assert all(torch.equal(s.read(i), payload(i)) for i in range(done))
    assert s.lookup(7) == ["ask"]  # still on disk: a later lookup may promote it


def on_disk_only(s: Shard, count: int) -> None:
    """Keys 0..count-1 on disk only (a pool of ``count`` slots, write-through, then as many more)."""
    for i in range(count):
        s.write(i)
    s.demote_all()
    for i in range(count, 2 * count):
        s.write(i)
    assert not any(s.in_pool(*range(count)))


def test_a_disk_slower_than_recomputing_is_not_read_until_a_probe_is_due(tmp_path, monkeypatch):
    s = Shard(str(tmp_path), 8, 64, write_through=True, recompute_bytes_s=1e12)  # no disk here reads 1 TB/s
    on_disk_only(s, 8)
    assert s.tier.promote([key(0)]) == [True]  # nothing measured yet: read, and measured
    assert s.tier.read_cost.samples == 1 and 0 < SLOT / s.tier.read_cost.seconds(SLOT) < 1e12
    evictions = s.index.stats().evictions
    assert s.tier.promote([key(i) for i in range(1, 5)]) == [False] * 4  # recomputing is faster
    assert s.tier.stats.promote_skipped == 4 and s.tier.stats.promoted == 1
    assert s.index.stats().evictions == evictions  # nothing reserved (nor evicted) for reads not made
    monkeypatch.setattr(tier_module, "PROBE_S", 0.0)
    monkeypatch.setattr(tier_module, "PROMOTE_CHUNK", 2)
    assert s.tier.promote([key(i) for i in range(1, 5)]) == [True, True, False, False]  # a probe: one chunk


def test_the_asking_engines_rate_decides_unless_the_fleet_set_one(tmp_path):
    """``disk_recompute_bytes_s`` 0: each lookup brings its engine's measured prefill rate. An
    engine that recomputes faster than this disk reads gets misses, a slow one (or one that has
    not measured yet: 0) gets its keys read; a rate the fleet set overrides the engines'."""
    s = Shard(str(tmp_path), 8, 64, write_through=True)
    on_disk_only(s, 8)
    assert s.tier.promote([key(0)]) == [True]  # measures the reads
    assert s.tier.promote([key(1), key(2)], recompute_bytes_s=1e12) == [False, False]  # no disk here reads 1 TB/s
    assert s.tier.stats.promote_skipped == 2
    assert s.tier.promote([key(1), key(2)], recompute_bytes_s=1e3) == [True, True]  # 1 KB/s: read
    assert s.tier.promote([key(3)]) == [True]  # no rate: read
    fleet = Shard(str(tmp_path / "fleet"), 8, 64, write_through=True, recompute_bytes_s=1e12)
    on_disk_only(fleet, 8)
    assert fleet.tier.promote([key(0)]) == [True]
    assert fleet.tier.promote([key(1)], recompute_bytes_s=1e3) == [False]  # the fleet's rate wins


def test_any_read_counts_as_the_probe(tmp_path, monkeypatch):
    """A probe re-measures a disk nothing was read from for ``PROBE_S``; every read measures it.
    It was due ``PROBE_S`` after the tier started, whatever was read since: a fast engine's first
    lookup on a shard up for longer read a chunk (32 keys) it was faster to recompute, right after
    a slow engine's read had measured the disk."""
    monkeypatch.setattr(tier_module, "PROBE_S", 1.0)
    s = Shard(str(tmp_path), 8, 64, write_through=True)
    on_disk_only(s, 8)
    time.sleep(1.1)  # the shard has been up for longer than PROBE_S
    assert s.tier.promote([key(0)], recompute_bytes_s=1e3) == [True]  # a slow engine's read: measured now
    assert s.tier.promote([key(1), key(2)], recompute_bytes_s=1e12) == [False, False]  # no probe owed


def test_a_lookup_reads_only_what_the_measured_rate_reads_within_its_wait(tmp_path, index_file, monkeypatch):
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 8, 16, index_file, write_through=True, wait_s=0.1,
                       store_args={"ops": SlowReads(0.04)})
    on_disk_only(s, 8)
    assert s.tier.promote([key(0)]) == [True]  # measures the cost: about a 40 ms read per SLOT
    assert s.tier.read_cost.samples == 1  # one size seen: bytes/s, no fixed part yet
    fits = int(0.1 / s.tier.read_cost.seconds(SLOT))
    assert 1 <= fits < 7, fits
    out = s.tier.promote([key(i) for i in range(1, 8)])
    assert out == [True] * fits + [False] * (7 - fits)  # the head, in prompt order
    assert s.tier.stats.promote_skipped == 7 - fits and s.tier.stats.promote_late == 0


def test_small_lookups_do_not_make_the_plan_cut_what_the_wait_reads(tmp_path, index_file, monkeypatch):
    """A read has a fixed cost (here 50 ms a read, as on a network disk) besides its bytes: a
    one-key lookup measures a low bytes/s that says nothing of a chunk's reads. After the small
    lookups of a conversation's later turns, a long prompt's keys must still be read when the
    wait covers them (16 keys: one chunk, one read, 50 ms against a 500 ms wait; on main, four
    rounds of reads, 200 ms)."""
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 40, 80, index_file, write_through=True, wait_s=0.5,
                       store_args={"ops": SlowReads(0.05)})
    on_disk_only(s, 40)
    assert s.tier.promote([key(i) for i in range(8)]) == [True] * 8  # one chunk: 64 KiB
    for i in range(8, 20):
        assert s.tier.promote([key(i)]) == [True]  # 8 KiB each
    out = s.tier.promote([key(i) for i in range(20, 36)])
    assert s.tier.stats.promote_skipped == 0 and out == [True] * 16, out


def test_the_recompute_rule_weighs_a_reads_fixed_cost_not_a_small_lookups_bytes_per_second(tmp_path, index_file,
                                                                                            monkeypatch):
    """Reads of 50 ms each, engines that recompute 400 KB of KV a second. A one-key lookup (8 KiB:
    50 ms to read, 20 ms to recompute) is not worth reading once the fixed cost is known; a 16-key
    chunk (128 KiB: one 50 ms read, 330 ms to recompute) is. A bytes/s averaged over the small
    lookups fell below 400 KB/s and read none of it."""
    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 32, 64, index_file, write_through=True, wait_s=1.0, recompute_bytes_s=4e5,
                       store_args={"ops": SlowReads(0.05)})
    on_disk_only(s, 32)
    assert s.tier.promote([key(i) for i in range(8)]) == [True] * 8  # nothing measured: read
    for i in range(8, 14):
        s.tier.promote([key(i)])
    out = s.tier.promote([key(i) for i in range(14, 30)])
    assert out == [True] * 16, (out, s.tier.stats)


def test_a_promotion_reads_only_within_what_is_left_of_its_askers_budget(tmp_path, index_file, monkeypatch):
    """Reads of 100 ms (on the tier's frozen clock), a ``wait_s`` of 1 s. An asker with 250 ms
    left gets the two keys whose reads end within them; the rest are cut by the plan (misses,
    recomputed), not read past the asker's deadline. An asker with nothing left gets no read: its
    disk keys are late."""
    digest_keys(monkeypatch)
    monkeypatch.setattr(store_module, "COALESCE_BYTES", SLOT)  # a read per key
    clock = AdvancingClock()
    clock.freeze()
    s = PublishedShard(str(tmp_path), 8, 16, index_file, write_through=True, wait_s=1.0, clock=clock,
                       store_args={"ops": ReadsOnClock(clock, 0.1)})
    on_disk_only(s, 8)
    assert s.tier.promote([key(0)]) == [True]  # measured: 100 ms a key
    out, lease, read = s.tier.promote_pinned([key(i) for i in range(1, 8)], budget_s=0.25)
    s.tier.unpin(lease)
    assert out == [True, True] + [False] * 5 and read == [0, 1], out
    assert s.tier.stats.promote_skipped == 5 and s.tier.stats.promote_late == 0
    out, lease, read = s.tier.promote_pinned([key(i) for i in range(3, 8)], budget_s=0.0)
    s.tier.unpin(lease)
    assert out == [False] * 5 and not read and s.tier.stats.promote_late == 5
    assert s.tier.stats.promoted == 3
    assert all(torch.equal(s.read(i), payload(i)) for i in (1, 2))  # what this asker was given


def pinned(s: Shard) -> bool:
    with s.lock:
        return s.index.stats().pins > 0


def test_a_promotion_that_waited_for_the_disk_plans_within_what_is_left(tmp_path, index_file, monkeypatch):
    """A promotion whose bound ran while it waited for the disk lock (a demotion batch's writes, or
    another promotion on the shard's other thread) reads only what ends within what is left: 750 ms
    of its 1 s waited, two 100 ms reads. It planned before taking the lock, for the whole second:
    it read all seven, the last ones started at its bound and ended past it."""
    digest_keys(monkeypatch)
    monkeypatch.setattr(store_module, "COALESCE_BYTES", SLOT)
    clock = AdvancingClock()
    clock.freeze()
    s = PublishedShard(str(tmp_path), 8, 16, index_file, write_through=True, wait_s=1.0, clock=clock,
                       store_args={"ops": ReadsOnClock(clock, 0.1)})
    on_disk_only(s, 8)  # 0..7 on disk only, 8..15 in the pool
    assert s.tier.promote([key(0)]) == [True]  # measured: 100 ms a key
    asked = [key(15)] + [key(i) for i in range(1, 8)]  # 15: in the pool, pinned first
    answers: list = []
    with s.tier._disk_lock:  # as a demotion batch holds it
        worker = threading.Thread(target=lambda: answers.append(s.tier.promote_pinned(asked)))
        worker.start()
        deadline = time.monotonic() + 30
        while not pinned(s):  # key 15 pinned: the promotion's bound runs
            assert time.monotonic() < deadline, "the promotion never pinned its pool hit"
            time.sleep(0.01)
        clock.advance(0.75)
    worker.join(timeout=30)
    out, lease, read = answers[0]
    s.tier.unpin(lease)
    assert out == [True, True, True] + [False] * 5 and read == [1, 2], out
    assert s.tier.stats.promote_skipped == 5 and s.tier.stats.promote_late == 0


def test_a_lookup_past_its_askers_deadline_counts_late_only_what_it_would_have_read(tmp_path, index_file,
                                                                                    monkeypatch):
    """Two askers out of time, one past its deadline when the shard takes its call up, one with
    time left but under ``READ_MARGIN_S`` (the tier's ``budget_s <= 0``): neither reads from disk,
    both get the pool's hits pinned, and each counts late what it left on disk, the keys the pool
    lacks. A key in the pool and on disk too (clean, as write-through leaves it) was not left on
    disk: ``disk_promote_late`` says what a longer budget would have read."""
    from types import SimpleNamespace

    from ucm_ray.store.shard.shard import READ_MARGIN_S, CacheShard

    digest_keys(monkeypatch)
    s = PublishedShard(str(tmp_path), 8, 16, index_file, write_through=True)
    on_disk_only(s, 8)  # 0..7 on disk only, 8..15 in the pool
    s.demote_all()  # 8..15 on disk too (clean)
    shard = SimpleNamespace(_check=lambda incarnation: None, _tier=s.tier, _lock=s.lock, _index=s.index)
    acquire = CacheShard.__ray_metadata__.modified_class._acquire
    asked = [key(8), key(9), key(0)]  # two pool hits, one key on disk only
    late = [s.tier.stats.promote_late]
    for until in (time.monotonic() + READ_MARGIN_S / 2, time.monotonic() - 1.0):
        lease, slots, read = acquire(shard, 1, READER, asked, 0.0, until)
        assert [slot is not None for slot in slots] == [True, True, False] and not read
        with s.lock:
            s.index.release(READER, [lease])
        late.append(s.tier.stats.promote_late)
    assert (late[1] - late[0], late[2] - late[1]) == (1, 1), "pool hits counted late"
