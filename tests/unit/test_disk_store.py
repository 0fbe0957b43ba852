"""The disk tier's store on real files under tmp_path: round trips, LRU, the bound, the lock,
adoption after a real process death at injected points, corruption, and a failing disk.

Faults come through ``FileOps`` (the store's one seam to the operating system): a subclass
raises ENOSPC/EIO or ends a forked child at a chosen call; every other call is the real one.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib

import pytest
import torch

from ucm_ray.store.shard.allocator import ExtentAllocator
from ucm_ray.store.shard.disk import DiskInUse, DiskStore, FileOps
from ucm_ray.store.shard.disk import store as store_module
from ucm_ray.store.shard.disk.fileops import aligned_buffer
from ucm_ray.store.shard.disk.manifest import DiskSlot, decode
from ucm_ray.store.shard.disk.store import MANIFEST, coalesce, shard_dir

SLOT = 8192
SHARD = "s0"


def key(i: int) -> bytes:
    return b"key-%d" % i


def payload(i: int, size: int = SLOT) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def read(store: DiskStore, k: bytes) -> torch.Tensor | None:
    size = store.size_of(k)
    if size is None:
        return None
    out = torch.empty(size, dtype=torch.uint8)
    return out if store.get(k, out) else None


@pytest.fixture
def root(tmp_path):
    return str(tmp_path)


def test_round_trip_aligned_odd_and_unaligned(root):
    store = DiskStore([root], SHARD, 16 * SLOT)
    base = payload(99, 3 * SLOT)
    items = {key(0): payload(0), key(1): payload(1, 5000), key(2): base[7:7 + SLOT]}  # odd size, odd address
    for k, v in items.items():
        assert store.put(k, v)
    for k, v in items.items():
        got = read(store, k)
        assert got is not None and torch.equal(got, v)
    assert not store.get(key(3), torch.empty(SLOT, dtype=torch.uint8))
    s = store.snapshot()
    assert (s.hits, s.misses, s.entries, s.writes) == (3, 1, 3, 3)
    assert s.direct_io  # ext4 under tmp_path takes O_DIRECT
    store.close()


def test_lru_evicts_the_least_recently_used(root):
    store = DiskStore([root], SHARD, 4 * SLOT)
    for i in range(4):
        assert store.put(key(i), payload(i))
    assert read(store, key(0)) is not None  # 0 is now the most recent; 1 the least
    assert store.put(key(4), payload(4))
    assert store.contains([key(i) for i in range(5)]) == [True, False, True, True, True]
    assert store.keys() == [key(2), key(3), key(0), key(4)]
    assert store.snapshot().evictions == 1
    store.close()


def test_never_past_disk_bytes(root):
    capacity = 40 * SLOT + 1234
    store = DiskStore([root], SHARD, capacity)
    sizes = [SLOT, 3 * SLOT, 4096, 5000, 2 * SLOT + 1]
    for i in range(200):
        assert store.put(key(i), payload(i, sizes[i % len(sizes)]))
        s = store.snapshot()
        assert s.used_bytes <= s.capacity_bytes <= capacity
    assert read(store, key(199)) is not None
    files = [os.path.join(shard_dir(root, SHARD), f) for f in os.listdir(shard_dir(root, SHARD))
             if f.startswith("data-")]
    assert sum(os.stat(f).st_size for f in files) == store.snapshot().capacity_bytes
    assert sum(os.stat(f).st_blocks * 512 for f in files) <= capacity
    store.close()


def test_an_entry_larger_than_a_file_is_refused(root):
    store = DiskStore([root], SHARD, 2 * SLOT)
    assert not store.put(key(0), payload(0, 3 * SLOT))
    assert store.snapshot().dropped_writes == 1 and store.enabled
    store.close()


def test_writes_spread_over_roots(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for r in roots:
        os.mkdir(r)
    store = DiskStore(roots, SHARD, 8 * SLOT)
    for i in range(6):
        assert store.put(key(i), payload(i))
    store.close()
    for r in roots:  # the manifest lives in the first root; data in both
        assert os.path.exists(os.path.join(shard_dir(r, SHARD), "data-0"))
    again = DiskStore(roots, SHARD, 8 * SLOT)
    assert {again.size_of(key(i)) for i in range(6)} == {SLOT}
    assert all(torch.equal(read(again, key(i)), payload(i)) for i in range(6))
    again.close()


def test_restart_adopts_in_a_new_generation_with_lru_order(root):
    store = DiskStore([root], SHARD, 8 * SLOT)
    for i in range(5):
        store.put(key(i), payload(i))
    read(store, key(0))
    gen = store.snapshot().generation
    store.close()
    again = DiskStore([root], SHARD, 8 * SLOT)
    s = again.snapshot()
    assert s.adopted == 5 and s.generation == gen + 1
    assert again.keys() == [key(1), key(2), key(3), key(4), key(0)]
    assert all(torch.equal(read(again, key(i)), payload(i)) for i in range(5))
    again.close()


def test_a_second_store_on_the_same_files_is_refused(root):
    store = DiskStore([root], SHARD, 4 * SLOT)
    with pytest.raises(DiskInUse, match="in use by another shard"):
        DiskStore([root], SHARD, 4 * SLOT)
    store.close()
    DiskStore([root], SHARD, 4 * SLOT).close()


def test_a_flipped_byte_is_a_miss_and_drops_the_entry(root):
    store = DiskStore([root], SHARD, 4 * SLOT)
    store.put(key(0), payload(0))
    store.put(key(1), payload(1))
    store.close()
    path = os.path.join(shard_dir(root, SHARD), "data-0")
    with open(path, "r+b") as f:  # both entries sit in the first two slots
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    again = DiskStore([root], SHARD, 4 * SLOT)
    got = [read(again, key(i)) for i in range(2)]
    assert sum(g is None for g in got) == 1  # the entry at offset 0 only
    good = next(i for i in range(2) if got[i] is not None)
    assert torch.equal(got[good], payload(good))
    assert again.snapshot().corrupt == 1 and again.snapshot().entries == 1
    again.close()


def test_a_batch_read_leaves_a_corrupt_entrys_destination_untouched(root):
    """Bytes that fail their check never reach the caller's memory (the pool slot a promotion
    reserved), not even uncommitted; the good entries of the same batch arrive intact."""
    store = DiskStore([root], SHARD, 8 * SLOT)
    for i in range(4):
        store.put(key(i), payload(i))
    bad = store.slot_of(key(2))
    store.close()
    with open(os.path.join(shard_dir(root, SHARD), "data-0"), "r+b") as f:
        f.seek(bad.offset + 5)
        byte = f.read(1)
        f.seek(bad.offset + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    again = DiskStore([root], SHARD, 8 * SLOT)
    outs = [torch.full((SLOT,), 0xAB, dtype=torch.uint8) for _ in range(4)]
    assert again.get_many([key(i) for i in range(4)], outs) == [True, True, False, True]
    assert all(torch.equal(outs[i], payload(i)) for i in (0, 1, 3))
    assert bool((outs[2] == 0xAB).all()), "a corrupt entry's bytes reached the destination"
    again.close()


class CountedReads(FileOps):
    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []  # (offset, bytes) of each preadv

    def preadv(self, fd, buffers, offset):
        self.reads.append((offset, sum(len(b) for b in buffers)))
        return super().preadv(fd, buffers, offset)


def test_adjacent_entries_are_read_together_up_to_the_cap(root, monkeypatch):
    """Entries lying next to each other in a file are one read (in either key order: demotion
    writes a prompt tail first), at most ``COALESCE_BYTES`` each; every entry is still checked
    and lands in its own destination."""
    monkeypatch.setattr(store_module, "COALESCE_BYTES", 4 * SLOT)
    ops = CountedReads()
    store = DiskStore([root], SHARD, 16 * SLOT, ops=ops)
    for i in reversed(range(6)):  # file order 5, 4, ..., 0
        store.put(key(i), payload(i))
    outs = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(6)]
    assert store.get_many([key(i) for i in range(6)], outs) == [True] * 6
    assert all(torch.equal(outs[i], payload(i)) for i in range(6))
    assert sorted(ops.reads) == [(0, 4 * SLOT), (4 * SLOT, 2 * SLOT)]  # keys 5..2, then 1 and 0
    store.close()


class CountedWrites(FileOps):
    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int]] = []  # (offset, bytes, buffers) of each pwritev

    def pwritev(self, fd, buffers, offset):
        self.writes.append((offset, sum(len(b) for b in buffers), len(buffers)))
        return super().pwritev(fd, buffers, offset)


def test_a_batch_writes_adjacent_entries_together_up_to_the_cap(root, monkeypatch):
    """``put_many`` writes entries that land next to each other as one vectored write (at most
    ``WRITE_RUN_BYTES``), data ``O_DIRECT`` cannot take as it is (odd size, odd address) one by
    one; every entry reads back, enters the LRU in the order given, and a restarted store
    adopts them all from the manifest."""
    monkeypatch.setattr(store_module, "WRITE_RUN_BYTES", 4 * SLOT)
    ops = CountedWrites()
    store = DiskStore([root], SHARD, 128 * SLOT, ops=ops)  # groups of 1/16 of the tier: 8 slots
    pool = torch.frombuffer(aligned_buffer(8 * SLOT), dtype=torch.uint8)  # page-aligned, as a shard's pool
    data = [pool[i * SLOT:(i + 1) * SLOT].copy_(payload(i)) for i in range(6)]
    data += [payload(6, 5000), pool[6 * SLOT + 7:7 * SLOT + 7].copy_(payload(7))]
    keys = [key(i) for i in range(8)]
    assert store.put_many(keys, data) == [True] * 8
    assert sorted(ops.writes) == [(0, 4 * SLOT, 4), (4 * SLOT, 2 * SLOT, 2), (6 * SLOT, SLOT, 1),
                                  (7 * SLOT, SLOT, 1)]
    assert store.keys() == keys
    assert all(torch.equal(read(store, k), v) for k, v in zip(keys, data))
    assert store.snapshot().writes == 8
    store.close()
    again = DiskStore([root], SHARD, 128 * SLOT)
    assert again.snapshot().adopted == 8
    assert all(torch.equal(read(again, k), v) for k, v in zip(keys, data))
    again.close()


def test_a_batch_larger_than_the_tier_keeps_its_last_entries(root):
    """Slots are allocated a group (1/16 of the tier) at a time: a batch that does not fit ends
    as puts one by one would, its last entries on disk, never its own entries evicted for
    room before they were listed, nothing past the bound."""
    store = DiskStore([root], SHARD, 4 * SLOT)
    keys = [key(i) for i in range(6)]
    assert store.put_many(keys, [payload(i) for i in range(6)]) == [True] * 6
    assert store.keys() == keys[2:]
    assert all(torch.equal(read(store, key(i)), payload(i)) for i in range(2, 6))
    assert store.snapshot().used_bytes <= 4 * SLOT
    store.close()


def test_a_key_twice_in_one_batch_is_written_once(root):
    store = DiskStore([root], SHARD, 8 * SLOT)
    assert store.put_many([key(0), key(1), key(0)], [payload(0), payload(1), payload(0)]) == [True] * 3
    s = store.snapshot()
    assert (s.writes, s.entries, s.used_bytes) == (2, 2, 2 * SLOT)
    store.close()


def test_a_write_failing_mid_batch_turns_the_tier_off_and_lists_none_of_it(root, monkeypatch):
    """The second run's write fails (EIO) while the first is on disk: the tier goes off and the
    batch reports nothing stored; a restarted store adopts none of it (no manifest listed it)."""
    monkeypatch.setattr(store_module, "WRITE_RUN_BYTES", 2 * SLOT)
    store = DiskStore([root], SHARD, 128 * SLOT, ops=FailingOps("pwritev", errno.EIO, after=1))
    pool = torch.frombuffer(aligned_buffer(6 * SLOT), dtype=torch.uint8)
    data = [pool[i * SLOT:(i + 1) * SLOT].copy_(payload(i)) for i in range(6)]
    assert store.put_many([key(i) for i in range(6)], data) == [False] * 6
    s = store.snapshot()
    assert (s.enabled, s.io_errors, s.entries, s.writes) == (False, 1, 0, 0)
    store.close()
    again = DiskStore([root], SHARD, 128 * SLOT)
    assert again.snapshot().adopted == 0 and again.keys() == []
    again.close()


def test_coalesce_groups_runs_per_file_and_orders_them_head_first(monkeypatch):
    monkeypatch.setattr(store_module, "COALESCE_BYTES", 3 * 4096)
    page = 4096
    slots = [DiskSlot(0, 5 * page, page, 0, 0), None, DiskSlot(1, 0, page, 0, 0), DiskSlot(0, 4 * page, page, 0, 0),
             DiskSlot(0, 0, page, 0, 0), DiskSlot(0, page, 100, 0, 0), DiskSlot(0, 2 * page, page, 0, 0),
             DiskSlot(0, 3 * page, page, 0, 0), DiskSlot(0, 6 * page, 2 * page, 0, 0)]
    # file 0 by offset: 4, 5 (100 bytes: a page), 6, 7, 3, 0, 8 (two pages); three pages a run at most
    assert coalesce(slots) == [[7, 3, 0], [2], [4, 5, 6], [8]]  # runs in file order, by their first key
    monkeypatch.setattr(store_module, "COALESCE_BYTES", page)
    assert coalesce([DiskSlot(0, 0, 3 * page, 0, 0), DiskSlot(0, 3 * page, page, 0, 0)]) == [[0], [1]]


def test_a_damaged_manifest_starts_empty_and_reuses_the_files(root):
    store = DiskStore([root], SHARD, 4 * SLOT)
    store.put(key(0), payload(0))
    store.close()
    path = os.path.join(shard_dir(root, SHARD), MANIFEST)
    data = bytearray(open(path, "rb").read())
    data[20] ^= 1
    open(path, "wb").write(bytes(data))
    again = DiskStore([root], SHARD, 4 * SLOT)
    assert again.snapshot().entries == 0
    assert all(again.put(key(i), payload(i)) for i in range(4))  # every slot is free again
    again.close()


def test_a_version_1_manifest_is_refused_not_misread(root, caplog):
    """Entries listed with CRC32 sums (format 1) are not adopted: their slots are free again."""
    store = DiskStore([root], SHARD, 4 * SLOT)
    assert store.put(key(0), payload(0))
    store.close()
    path = os.path.join(shard_dir(root, SHARD), MANIFEST)
    listed = decode(open(path, "rb").read())
    body = [struct.pack("<8sIIQQQ", b"UCMDISK\x01", 1, listed.layout.files, listed.layout.file_bytes,
                        listed.generation, len(listed.entries))]
    for k, slot in listed.entries:  # as format 1 wrote them: each entry's CRC32
        crc = zlib.crc32(memoryview(payload(0).numpy()))
        body += [struct.pack("<HHQQIQ", len(k), slot.file, slot.offset, slot.size, crc, slot.generation), k]
    old = b"".join(body)
    open(path, "wb").write(old + struct.pack("<I", zlib.crc32(old)))
    with caplog.at_level(logging.WARNING):
        again = DiskStore([root], SHARD, 4 * SLOT)
    assert again.snapshot().adopted == 0 and read(again, key(0)) is None
    assert "version-1" in caplog.text
    assert all(again.put(key(i), payload(i)) for i in range(4))  # every slot is free again
    again.close()


def test_a_changed_layout_starts_empty(root):
    store = DiskStore([root], SHARD, 4 * SLOT)
    store.put(key(0), payload(0))
    store.close()
    again = DiskStore([root], SHARD, 2 * SLOT)
    assert again.snapshot().entries == 0
    assert os.stat(os.path.join(shard_dir(root, SHARD), "data-0")).st_size == 2 * SLOT
    again.close()


class RefuseDirect(FileOps):
    def open(self, path, flags, mode=0o600):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return super().open(path, flags, mode)


def test_buffered_io_where_o_direct_is_refused(root, caplog):
    caplog.set_level(logging.INFO, logger="ucm_ray.store.shard.disk.store")
    store = DiskStore([root], SHARD, 4 * SLOT, ops=RefuseDirect())
    assert not store.snapshot().direct_io
    assert store.put(key(0), payload(0, 5000))
    assert torch.equal(read(store, key(0)), payload(0, 5000))
    assert any("O_DIRECT refused" in r.getMessage() for r in caplog.records)
    store.close()


class FailingOps(FileOps):
    """The real calls, until call number ``after`` of ``op``, which raises ``err`` from then on."""

    def __init__(self, op: str, err: int, after: int = 0) -> None:
        self.op, self.err, self.left = op, err, after

    def _maybe_fail(self, op: str) -> None:
        if op == self.op:
            if self.left <= 0:
                raise OSError(self.err, os.strerror(self.err))
            self.left -= 1

    def fallocate(self, fd, size):
        self._maybe_fail("fallocate")
        super().fallocate(fd, size)

    def pwritev(self, fd, buffers, offset):
        self._maybe_fail("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):
        self._maybe_fail("preadv")
        return super().preadv(fd, buffers, offset)

    def fsync(self, fd):
        self._maybe_fail("fsync")
        super().fsync(fd)


@pytest.mark.parametrize("op, err", [("pwritev", errno.ENOSPC), ("pwritev", errno.EIO),
                                     ("preadv", errno.EIO), ("fsync", errno.EIO)])
def test_a_failing_disk_turns_the_tier_off_once(root, caplog, op, err):
    store = DiskStore([root], SHARD, 8 * SLOT, ops=FailingOps(op, err, after=2))
    caplog.set_level(logging.INFO, logger="ucm_ray.store.shard.disk.store")
    for i in range(4):
        store.put(key(i), payload(i))
        read(store, key(i))
        store.checkpoint()
    s = store.snapshot()
    assert not s.enabled and s.io_errors == 1 and s.entries == 0
    assert not store.put(key(9), payload(9)) and read(store, key(0)) is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errno.errorcode[err] in errors[0].getMessage() and "turned off" in errors[0].getMessage()
    store.close()


def test_no_room_to_preallocate_leaves_the_tier_off(root, caplog):
    store = DiskStore([root], SHARD, 8 * SLOT, ops=FailingOps("fallocate", errno.ENOSPC))
    assert not store.enabled and not store.put(key(0), payload(0))
    assert "ENOSPC" in caplog.text
    store.close()


class CrashOps(FileOps):
    """Ends the process (as ``kill -9`` would: no cleanup, no flush of Python state) right after
    call number ``n`` of ``op`` returned."""

    def __init__(self, op: str, n: int) -> None:
        self.op, self.n = op, n

    def _after(self, op: str) -> None:
        if op == self.op:
            self.n -= 1
            if self.n == 0:
                os._exit(9)

    def pwritev(self, fd, buffers, offset):
        done = super().pwritev(fd, buffers, offset)
        self._after("pwritev")
        return done

    def write_synced(self, path, data):
        super().write_synced(path, data)
        self._after("write_synced")

    def replace(self, src, dst):
        super().replace(src, dst)
        self._after("replace")

    def fsync_dir(self, path):
        super().fsync_dir(path)
        self._after("fsync_dir")


CAP = 4 * SLOT


def workload(store: DiskStore) -> list[set[bytes]]:
    """Fill, checkpoint, then keep writing past the capacity (each write evicts a listed entry,
    retires its slot and writes a manifest first); returns what each manifest listed."""
    listed = []
    for i in range(3):
        store.put(key(i), payload(i))
    store.checkpoint()
    listed.append(set(store.keys()))
    for i in range(3, 9):
        before = store.snapshot().manifests
        store.put(key(i), payload(i))
        if store.snapshot().manifests != before:
            listed.append(set(store.keys()) - {key(i)})
    return listed


def run_child(root: str, ops: FileOps) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child ends in os._exit either way
        try:
            workload(DiskStore([root], SHARD, CAP, ops=ops))
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("op, n", [("pwritev", 4),       # mid-demotion: data written, not listed
                                   ("pwritev", 6),       # after a retire + manifest, the next write
                                   ("write_synced", 2),  # mid-manifest: temp written, not renamed
                                   ("replace", 2),       # renamed, directory not synced
                                   ("fsync_dir", 3)])
def test_killed_at_an_injected_point_then_adopted(tmp_path, op, n):
    """Every adopted entry verifies byte for byte, the adopted set is what one manifest listed,
    and no slot leaks: what is not adopted is free for new writes."""
    listings = workload(DiskStore([str(tmp_path / "ref")], SHARD, CAP))
    root = str(tmp_path / "crash")
    os.mkdir(root)
    status = run_child(root, CrashOps(op, n))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 9, status
    store = DiskStore([root], SHARD, CAP)
    s = store.snapshot()
    adopted = set(store.keys())
    assert adopted in listings and s.refused_at_adoption == 0
    for k in adopted:
        i = int(k.split(b"-")[1])
        got = read(store, k)
        assert got is not None and torch.equal(got, payload(i)), k
    assert s.used_bytes == len(adopted) * SLOT
    for i in range(100, 100 + 4 - len(adopted)):  # the rest is free: no eviction needed
        assert store.put(key(i), payload(i))
    assert store.snapshot().evictions == 0
    store.close()


def test_allocator_take_marks_an_extent_used():
    a = ExtentAllocator(16 * 4096, align=4096)
    a.take(4 * 4096, 8192)
    assert a.free_bytes == 14 * 4096
    with pytest.raises(ValueError):
        a.take(5 * 4096, 4096)  # overlaps
    offs = {a.alloc(4096) for _ in range(14)}
    assert offs.isdisjoint({4 * 4096, 5 * 4096}) and a.alloc(4096) is None
    a.free(4 * 4096, 8192)
    assert a.alloc(8192) == 4 * 4096
