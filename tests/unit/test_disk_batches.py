"""Property tests of the disk tier's batched writes (``DiskStore.put_many``, hypothesis): random
batches (keys repeated, present already or not, odd sizes, unaligned data, batches larger than
the tier), reads, manifests, clean restarts and crashes (a store dropped without its last
manifest) on real files. Every system call goes to the disk as it is; an ``Audit`` watches
them for the crash-consistency rules as they happen:

- no write touches a slot that a manifest which may be the one on disk lists;
- a manifest lists only slots whose bytes were written and fsynced before it.

After every step: the bound holds, no byte of the files is lost to the allocators (free plus
used is the capacity), entries never overlap, and every entry reads back its own bytes; after
a crash, what is adopted is what the last durable manifest listed, byte for byte."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ucm_ray.store.shard.disk import DiskStore, FileOps
from ucm_ray.store.shard.disk import store as store_module
from ucm_ray.store.shard.disk.fileops import DIRECT_ALIGN, aligned_buffer, round_up
from ucm_ray.store.shard.disk.manifest import decode

SIZES = [4096, 8192, 5000, 12288, 100, 4096, 8192]
"""Entry size of key k: ``SIZES[k % 7]`` (a key names its bytes, as a block's hash does)."""
KEYS = 30

Listing = frozenset[tuple[bytes, int, int, int]]
"""(key, file, offset, size) of each entry one manifest lists."""


def key(k: int) -> bytes:
    return b"key-%d" % k


def payload(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randint(0, 256, (SIZES[k % len(SIZES)],), dtype=torch.uint8, generator=g)


class Audit(FileOps):
    """The real calls, checked as they happen against the crash-consistency rules."""

    def __init__(self, listed: Listing = frozenset()) -> None:
        self.files: list[int] = []  # fds in open order: the store's file numbers
        self.durable: list[Listing] = [listed]
        """Listings any of which a crash now could leave as the manifest (two between a rename
        and the directory's fsync)."""
        self.pending: Listing = frozenset()
        self.clock = 0
        self.written: dict[tuple[int, int], int] = {}  # (file, page) -> when last written
        self.synced: dict[int, int] = {}  # file -> when last fsynced
        self.violations: list[str] = []
        self.most = 0  # buffers of the longest vectored write
        self.failing: tuple[str, int] | None = None
        """(call, n): the n-th next such call raises EIO once it has done its work."""

    def _maybe_fail(self, call: str) -> None:
        if self.failing is not None and self.failing[0] == call:
            left = self.failing[1] - 1
            self.failing = None if left == 0 else (call, left)
            if left == 0:
                raise OSError(errno.EIO, f"injected: {call}")

    def adopted(self, store: DiskStore) -> None:
        """What the store adopted was written and synced in an earlier life."""
        for _, file, offset, size in self.durable[0]:
            for page in range(offset, offset + round_up(size), DIRECT_ALIGN):
                self.written[(file, page)] = -1
        self.synced = dict.fromkeys(range(len(self.files)), -1)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def open_data(self, path: str, size: int) -> tuple[int, bool]:
        fd, direct = super().open_data(path, size)
        self.files.append(fd)
        return fd, direct

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self.most = max(self.most, len(buffers))
        file, end = self.files.index(fd), offset + sum(len(b) for b in buffers)
        for listing in self.durable:
            for k, f, at, size in listing:
                if f == file and at < end and offset < at + round_up(size):
                    self.violations.append(f"write of file {file} [{offset}, {end}) over {k!r} listed at {at}")
        done = super().pwritev(fd, buffers, offset)
        now = self._tick()
        for page in range(offset, end, DIRECT_ALIGN):
            self.written[(file, page)] = now
        self._maybe_fail("pwritev")
        return done

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        if fd in self.files:
            self._maybe_fail("fsync")
            self.synced[self.files.index(fd)] = self._tick()

    def write_synced(self, path: str, data: bytes) -> None:
        manifest = decode(data)
        self.pending = frozenset((k, s.file, s.offset, s.size) for k, s in manifest.entries)
        for k, file, offset, size in self.pending:
            for page in range(offset, offset + round_up(size), DIRECT_ALIGN):
                when = self.written.get((file, page))
                if when is None or when > self.synced.get(file, -2):
                    self.violations.append(f"manifest lists {k!r} at {file}:{offset}, page {page} "
                                           f"{'never written' if when is None else 'not synced'}")
        super().write_synced(path, data)
        self._maybe_fail("write_synced")

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        self.durable.append(self.pending)

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self.durable = self.durable[-1:]


def _data(k: int, aligned: bool, pool: torch.Tensor, at: int) -> torch.Tensor:
    """Key k's bytes in page-aligned pool memory (written as they are, in runs) or one byte off
    (through the bounce buffer)."""
    data = payload(k)
    start = at + (0 if aligned else 8)
    return pool[start: start + data.numel()].copy_(data)


def _check(store: DiskStore, audit: Audit) -> None:
    assert not audit.violations, audit.violations
    s = store.snapshot()
    assert s.used_bytes <= s.capacity_bytes
    assert sum(a.free_bytes for a in store._allocs) + s.used_bytes == s.capacity_bytes, "bytes leaked"
    slots = sorted((slot.file, slot.offset, round_up(slot.size)) for k in store.keys()
                   if (slot := store.slot_of(k)) is not None)
    for (f1, o1, n1), (f2, o2, _) in zip(slots, slots[1:]):
        assert f1 != f2 or o1 + n1 <= o2, "entries overlap"
    for k in store.keys():
        i = int(k.split(b"-")[1])
        out = torch.empty(store.size_of(k) or 0, dtype=torch.uint8)
        assert store.get(k, out) and torch.equal(out, payload(i)), k
    assert store.snapshot().corrupt == 0


Op = tuple[str, list[int], list[bool]]

puts = st.tuples(st.just("put"), st.lists(st.integers(0, KEYS - 1), min_size=3, max_size=24),
                 st.lists(st.sampled_from([True, True, True, False]), min_size=24, max_size=24))
ops = st.one_of(
    puts, puts, puts,
    st.tuples(st.just("get"), st.lists(st.integers(0, KEYS - 1), max_size=6), st.just([])),
    st.tuples(st.sampled_from(["checkpoint", "restart", "crash"]), st.just([]), st.just([])),
    st.tuples(st.sampled_from(["pwritev", "fsync", "write_synced"]), st.lists(st.integers(1, 4), min_size=1,
                                                                             max_size=1), st.just([])),
)


@settings(max_examples=150, deadline=None)
@given(capacity_pages=st.integers(6, 24), roots=st.integers(1, 2), files_per_root=st.integers(1, 2),
       run_pages=st.sampled_from([1, 2, 4, 2048]), ahead=st.sampled_from([2, 4, 16]),
       steps=st.lists(ops, min_size=2, max_size=14))
def test_batches_keep_the_bound_the_bytes_and_the_manifest_rules(capacity_pages, roots, files_per_root, run_pages,
                                                                 ahead, steps: list[Op]):
    """``ahead``: ``EVICT_AHEAD``, so that a small tier's groups (1/``ahead`` of it) hold runs."""
    saved = store_module.WRITE_RUN_BYTES, store_module.EVICT_AHEAD
    store_module.WRITE_RUN_BYTES, store_module.EVICT_AHEAD = run_pages * DIRECT_ALIGN, ahead
    pool = torch.frombuffer(aligned_buffer(24 * 4 * DIRECT_ALIGN), dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [os.path.join(tmp, f"root{r}") for r in range(roots)]
        for d in dirs:
            os.mkdir(d)

        def open_store(listed: Listing) -> tuple[DiskStore, Audit]:
            audit = Audit(listed)
            store = DiskStore(dirs, "s0", capacity_pages * DIRECT_ALIGN, files_per_root=files_per_root, ops=audit)
            adopted = frozenset((k, s.file, s.offset, s.size) for k in store.keys() if (s := store.slot_of(k)))
            assert adopted == listed, "adopted what the durable manifest listed"
            audit.adopted(store)
            return store, audit

        store, audit = open_store(frozenset())
        evictions = manifests = 0
        file_bytes = store.snapshot().capacity_bytes // (roots * files_per_root)
        try:
            for name, keys, aligned in steps:
                if name == "put":
                    before = set(store.keys())
                    datas = [_data(k, a, pool, i * 4 * DIRECT_ALIGN) for i, (k, a) in enumerate(zip(keys, aligned))]
                    done = store.put_many([key(k) for k in keys], datas)
                    after = set(store.keys())
                    for k, ok in zip(keys, done):
                        assert ok or key(k) not in after, "a key on disk reported not stored"
                        assert ok or not store.enabled or round_up(SIZES[k % len(SIZES)]) > file_bytes, k
                    fresh = [key(k) for k in dict.fromkeys(keys) if key(k) not in before and key(k) in after]
                    assert [k for k in store.keys() if k in fresh] == fresh, "fresh keys enter the LRU in order"
                elif name == "get":
                    for k in keys:
                        out = torch.empty(SIZES[k % len(SIZES)], dtype=torch.uint8)
                        assert store.get(key(k), out) == (key(k) in store.keys())
                elif name == "checkpoint":
                    store.checkpoint()
                elif name in ("pwritev", "fsync", "write_synced"):
                    audit.failing = (name, keys[0])  # armed: the n-th next such call fails
                    continue
                else:
                    evictions, manifests = evictions + store.stats.evictions, manifests + store.stats.manifests
                    crash = name == "crash" or not store.enabled
                    held = frozenset((k, s.file, s.offset, s.size) for k in store.keys() if (s := store.slot_of(k)))
                    store.close(checkpoint=not crash)
                    listed = audit.durable[-1]
                    assert crash or not store.enabled or listed == held, "a clean close lists every entry"
                    store, audit = open_store(listed)
                if store.enabled:
                    _check(store, audit)
                else:  # a call failed: the tier is off and holds nothing; a restart adopts the last manifest
                    assert not audit.violations and store.keys() == [] and store.snapshot().io_errors == 1
            manifests = min(manifests + store.stats.manifests, 2)
            event(f"evicted: {evictions + store.stats.evictions > 0}, manifests: {manifests}, on: {store.enabled}")
            event(f"vectored: {audit.most > 1}")
        finally:
            store.close()
            store_module.WRITE_RUN_BYTES, store_module.EVICT_AHEAD = saved
