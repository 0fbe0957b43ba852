"""A shard's index, published read-only in shared memory: same-node lookups without a Ray call.

A lookup through Ray costs a round trip (~1 ms here, several on a busy host),
and a store-warm prompt pays it before vLLM may schedule it. But on one node
the shard and its readers share memory: the shard keeps a copy of its
key -> entry map in a ``/dev/shm`` file that readers map read-only, so a miss
is answered in microseconds and a hit needs no pin.

Pins are replaced by *validation*. Every published entry has a generation,
unique within one incarnation of the shard. A reader notes it at lookup,
copies the bytes without a pin, then looks the key up again: the same
generation means the entry stayed listed the whole time, so its slot was never
freed, never handed to a writer, and the bytes copied are the entry's (a slot
is unlisted here before the shard can grant it to anyone). Another generation
or none is a failed load (vLLM recomputes, ``get`` reports a miss): never wrong
bytes. Readers tell the shard what they read, off the critical path
(``CacheShard.touch``), so read entries stay recently used and are evicted last.

The table: open addressing with linear probing over 64-byte buckets after a
64-byte header, keys are 16-byte digests (``keys.KEY_BYTES``, uniformly
spread, so their low word picks the bucket). One writer, the shard, under its
lock; any number of readers in other processes, never blocked:
- per bucket a seqlock: ``seq`` odd while the writer changes it; a reader
  takes a bucket only if ``seq`` was even and the same before and after;
- a rebuild (dropping tombstones) makes the header's ``epoch`` odd until done;
  a reader whose lookup saw the epoch change looks again;
- when the table is too full to take an entry, ``complete`` is cleared: a miss
  is then not an answer, and the reader asks the shard through Ray.

These rules rely on x86's ordering of plain loads and stores (total store
order); elsewhere (aarch64) no reader maps the table and lookups go through
Ray, as between nodes.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ucm_ray.keys import KEY_BYTES
from ucm_ray.store.blockstore import NO_CHECKSUM, Locations
from ucm_ray.transport.base import PoolDescriptor, PoolKey

log = logging.getLogger(__name__)

BUCKET: np.dtype = np.dtype([("seq", "<u8"), ("key_lo", "<u8"), ("key_hi", "<u8"), ("offset", "<i8"),
                   ("size", "<i8"), ("generation", "<u8"), ("checksum", "<i8"), ("unused", "<u8")])
HEADER: np.dtype = np.dtype([("magic", "<u8"), ("epoch", "<u8"), ("buckets", "<u8"), ("complete", "<u8"),
                   ("incarnation", "<u8"), ("unused", "<u8", 3)])
FIELDS = ("key_lo", "key_hi", "offset", "size", "generation", "checksum")
"""A bucket's fields between ``seq`` and the unused word, in order."""
MAGIC = 0x31584449_59415255  # "URAYIDX1"
EMPTY = 0
TOMBSTONE = np.uint64(2**64 - 1)
MAX_LOAD = 0.5
"""Live entries per bucket beyond which the table takes no more (probe chains stay short)."""
BYTES_PER_BUCKET = 16 << 10
"""Pool bytes per bucket: entries of 32 KiB and up all fit at ``MAX_LOAD``; smaller ones fit
until the table is full, then lookups of what did not fit go through Ray."""
ORDERED_LOADS = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
"""Whether this CPU keeps plain loads and stores in order, as the seqlocks need (x86)."""


def table_buckets(pool_bytes: int) -> int:
    """Buckets for a pool of ``pool_bytes``: a power of two, at least 1024."""
    want = max(1024, 2 * pool_bytes // BYTES_PER_BUCKET)
    return 1 << (want - 1).bit_length()


def index_bytes(pool_bytes: int) -> int:
    """Size of the index file of a pool of ``pool_bytes`` (1/128 to 1/64 of it, at least 64 KiB)."""
    return HEADER.itemsize + table_buckets(pool_bytes) * BUCKET.itemsize


def index_path(pool_path: str) -> str:
    """The index file of a pool file (same directory and prefix: stale-pool cleanup covers it)."""
    return pool_path + "-index"


def _words(keys: Sequence[bytes]) -> np.ndarray:
    """Keys as an ``[n, 2]`` array of little-endian words."""
    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        raise ValueError(f"published index keys must be {KEY_BYTES} bytes each")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)


class PublishedIndex:
    """The shard's side: a table it alone writes (called under the shard's lock)."""

    def __init__(self, path: str, pool_bytes: int, incarnation: int) -> None:
        self.path = path
        self.buckets = table_buckets(pool_bytes)
        size = index_bytes(pool_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # zero pages, reserved now: all buckets empty
                self._mmap = mmap.mmap(fd, size)
            except OSError as e:
                os.unlink(path)
                raise OSError(e.errno, f"cannot reserve {size} bytes for shard index {path}: {e.strerror}") from e
        finally:
            os.close(fd)
        self._header = np.frombuffer(self._mmap, dtype=HEADER, count=1)
        self._table = np.frombuffer(self._mmap, dtype=BUCKET, offset=HEADER.itemsize, count=self.buckets)
        self._mask = self.buckets - 1
        self._where: dict[bytes, int] = {}  # key -> its bucket
        self._tombstones = 0
        self._generation = 0
        self._header[0] = (MAGIC, 0, self.buckets, 1, incarnation, (0, 0, 0))

    def publish(self, key: bytes, offset: int, size: int, checksum: int | None) -> int:
        """List a committed entry; its generation, or 0 when it is not listed: the table has no
        room for it (then readers ask the shard for what they do not find), or the key is not a
        ``KEY_BYTES`` digest (readers never look such keys up here)."""
        if len(key) != KEY_BYTES:
            return 0
        if key in self._where:  # never two buckets for one key: the older would outlive its slot
            self.unpublish(key)
        if len(self._where) + 1 > MAX_LOAD * self.buckets:
            self._header["complete"] = 0
            return 0
        if len(self._where) + self._tombstones + 1 > 0.75 * self.buckets:
            self._rebuild()
        self._generation += 1
        lo, hi = (int(w) for w in _words([key])[0])
        at = lo & self._mask
        while self._table["generation"][at] not in (EMPTY, TOMBSTONE):
            at = (at + 1) & self._mask
        if self._table["generation"][at] == TOMBSTONE:
            self._tombstones -= 1
        self._write(at, (lo, hi, offset, size, self._generation, NO_CHECKSUM if checksum is None else checksum))
        self._where[key] = at
        return self._generation

    def unpublish(self, key: bytes) -> None:
        """Unlist an entry (evicted or removed) before its slot can go to anyone else."""
        at = self._where.pop(key, None)
        if at is None:
            return
        row = self._table[at]
        self._write(at, (row["key_lo"], row["key_hi"], row["offset"], row["size"], TOMBSTONE, row["checksum"]))
        self._tombstones += 1

    def refill(self, entries: Iterable[tuple[bytes, int, int, int | None]]) -> dict[bytes, int]:
        """Publish committed entries that found no room before (``complete`` again once all of
        them are in); their generations. The shard calls it when unlisting made room."""
        out: dict[bytes, int] = {}
        for key, offset, size, checksum in entries:
            if len(key) != KEY_BYTES:
                continue  # never listed (readers ask the shard for such keys): nothing waits on it
            generation = self.publish(key, offset, size, checksum)
            if not generation:
                return out
            out[key] = generation
        self._header["complete"] = 1
        return out

    def __len__(self) -> int:
        return len(self._where)

    @property
    def complete(self) -> bool:
        return bool(self._header["complete"][0])

    @property
    def wants_refill(self) -> bool:
        """Incomplete, and room for a fifth of the table since: worth a refill."""
        return not self.complete and len(self._where) < 0.8 * MAX_LOAD * self.buckets

    def close(self) -> None:
        del self._header, self._table  # the views, so the mapping can close
        try:
            self._mmap.close()
        except BufferError:
            log.warning("index %s still has live views; leaving the mapping to the GC", self.path)
        Path(self.path).unlink(missing_ok=True)

    def _write(self, at: int, fields: tuple) -> None:
        """One bucket under its seqlock: odd while it changes (stores stay in order on x86)."""
        seq = int(self._table["seq"][at])
        self._table["seq"][at] = seq + 1
        self._table[at] = (seq + 1, *fields, 0)
        self._table["seq"][at] = seq + 2

    def _rebuild(self) -> None:
        """Drop tombstones: every live entry placed again while ``epoch`` is odd, as arrays (a
        Python loop over a large table held the shard's lock for seconds). Entries sorted by home
        bucket take ``max(home, previous + 1)``; those pushed past the end take the first free
        buckets from the start, where every bucket before them is taken: each entry's probe chain
        from its home stays unbroken, which is all linear probing needs."""
        keys = list(self._where)
        live = self._table[np.fromiter(self._where.values(), dtype=np.int64, count=len(keys))].copy()
        self._header["epoch"] += 1
        home = (live["key_lo"] & np.uint64(self._mask)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        steps: np.ndarray = np.arange(len(order), dtype=np.int64)
        at = np.maximum.accumulate(home[order] - steps) + steps if len(order) else steps
        wrapped = at >= self.buckets
        if wrapped.any():
            free = np.setdiff1d(np.arange(self.buckets, dtype=np.int64), at[~wrapped], assume_unique=True)
            at[wrapped] = free[: int(wrapped.sum())]
        rows = live[order]
        rows["seq"] = 0
        self._table["seq"] += 2  # every bucket even and changed: no reader keeps a read from before
        self._table["generation"] = EMPTY
        seqs = self._table["seq"][at]
        self._table[at] = rows
        self._table["seq"][at] = seqs
        self._where = {keys[i]: int(pos) for i, pos in zip(order.tolist(), at.tolist())}
        self._tombstones = 0
        self._header["epoch"] += 1


@dataclass(frozen=True)
class Found:
    """A lookup's answer, per key: ``generation`` 0 is a miss; ``known`` False means the table
    could not say (it is incomplete and the key is not in it): ask the shard."""

    generation: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    checksum: np.ndarray
    known: np.ndarray


class IndexReader:
    """A reader's read-only mapping of one shard's published index."""

    RETRIES = 8

    def __init__(self, path: str, incarnation: int, *, populate: bool = False) -> None:
        """``populate``: map every page at once (``IndexReaders`` does so off the engine's
        path): a fresh engine's first lookups otherwise took a page fault per bucket probed
        (1,024 keys: 3-3.5 ms against 0.6 ms once mapped, on a 2-core box)."""
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        self._header = np.frombuffer(self._mmap, dtype=HEADER, count=1)
        head = self._header[0]
        if int(head["magic"]) != MAGIC or int(head["incarnation"]) != incarnation:
            del self._header, head
            self._mmap.close()
            raise ValueError(f"{path} is not the index of incarnation {incarnation:x}")
        self.buckets = int(head["buckets"])
        self._table = np.frombuffer(self._mmap, dtype=BUCKET, offset=HEADER.itemsize, count=self.buckets)
        self._mask = np.uint64(self.buckets - 1)

    def lookup(self, keys: Sequence[bytes]) -> Found | None:
        """Per key, the listed entry, read consistently; None if the shard kept rebuilding."""
        words = _words(keys)
        for _ in range(self.RETRIES):
            epoch = int(self._header["epoch"][0])
            if epoch & 1:
                time.sleep(0.0001)
                continue
            found = self._probe(words)
            if int(self._header["epoch"][0]) == epoch:
                return found
        return None

    def generation_of(self, key: bytes) -> int | None:
        """``lookup`` of one key without arrays: the generation listed for it (0: not listed), or
        None where the index cannot say (a torn bucket, a rebuild meanwhile, a miss in a table
        that is not complete). Every cold prompt asks this of its first block; the vectorized
        probe's fixed cost (~50 numpy calls) was most of that lookup's host time."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"published index keys must be {KEY_BYTES} bytes each")
        lo, hi = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
        epoch = int(self._header["epoch"][0])
        if epoch & 1:
            return None
        complete = bool(self._header["complete"][0])
        seqs, mask = self._table["seq"], self.buckets - 1
        at, answer = lo & mask, None
        for _ in range(self.buckets):
            before = int(seqs[at])
            _, key_lo, key_hi, _, _, generation, _, _ = self._table[at].item()
            if before & 1 or int(seqs[at]) != before:
                return None  # mid-update: the vectorized lookup reads it again, or asks the shard
            if generation == EMPTY:
                answer = 0 if complete else None
                break
            if generation != TOMBSTONE and key_lo == lo and key_hi == hi:
                answer = generation
                break
            at = (at + 1) & mask
        return answer if int(self._header["epoch"][0]) == epoch else None

    def validate(self, keys: Sequence[bytes], generations: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per key, whether the entry of that generation is still listed (its copy is good)."""
        found = self.lookup(keys)
        if found is None:
            return np.zeros(len(keys), dtype=bool)
        return found.generation == np.asarray(generations, dtype=np.uint64)

    def close(self) -> None:
        del self._header, self._table  # the views, so the mapping can close
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view still lives: the GC unmaps it

    def _probe(self, words: np.ndarray) -> Found:
        n = len(words)
        lo, hi = words[:, 0], words[:, 1]
        generation: np.ndarray = np.zeros(n, dtype=np.uint64)
        offset: np.ndarray = np.zeros(n, dtype=np.int64)
        size: np.ndarray = np.zeros(n, dtype=np.int64)
        checksum: np.ndarray = np.full(n, NO_CHECKSUM, dtype=np.int64)
        complete = bool(self._header["complete"][0])
        known: np.ndarray = np.ones(n, dtype=bool)
        todo = np.arange(n)
        at = lo & self._mask
        seqs = self._table["seq"]
        torn_rounds = 0
        for _ in range(self.buckets + self.RETRIES):
            if not len(todo):
                break
            where = at[todo]
            before = seqs[where]
            rows = self._table[where]
            steady = (before == seqs[where]) & (before & np.uint64(1) == 0)
            gen = rows["generation"]
            live = (gen != EMPTY) & (gen != TOMBSTONE)
            hit = steady & live & (rows["key_lo"] == lo[todo]) & (rows["key_hi"] == hi[todo])
            miss = steady & (gen == EMPTY)
            found = todo[hit]
            generation[found] = gen[hit]
            offset[found] = rows["offset"][hit]
            size[found] = rows["size"][hit]
            checksum[found] = rows["checksum"][hit]
            known[todo[miss]] = complete
            step = steady & ~hit & ~miss  # another key or a tombstone: the chain goes on
            at[todo[step]] = (at[todo[step]] + np.uint64(1)) & self._mask
            settled = hit | miss
            if not steady.all():  # torn reads are read again, a few times: a bucket left
                torn_rounds += 1  # mid-update by a shard that paused or died stays unanswered
                if torn_rounds > self.RETRIES:
                    known[todo[~steady]] = False
                    settled |= ~steady
            todo = todo[~settled]
        known[todo] = False
        return Found(generation, offset, size, checksum, known)


class IndexReaders:
    """One process's mappings of the published indexes it can read: pools on its own node that
    publish one, on a CPU whose ordering the seqlocks rely on. Synced with membership like
    ``PoolConnections``: an old incarnation's mapping is closed before anything reads it."""

    def __init__(self, node_id: str | None) -> None:
        """``node_id``: this process's node (None: read no index, every lookup is a call)."""
        self._node_id = node_id
        self._descriptors: dict[PoolKey, PoolDescriptor] = {}
        self._open: dict[PoolKey, IndexReader | None] = {}
        self._opening: dict[PoolKey, Future[IndexReader | None]] = {}

    def sync(self, descriptors: Mapping[PoolKey, PoolDescriptor]) -> None:
        """Adopt the pools; this node's new indexes start mapping on a thread of their own (a
        large pool's index takes milliseconds to map whole), so the next lookup finds them
        ready."""
        self._descriptors = dict(descriptors)
        for key in [k for k in self._open if k not in self._descriptors]:
            reader = self._open.pop(key)
            if reader is not None:
                reader.close()
        for key in [k for k in self._opening if k not in self._descriptors]:
            self._opening.pop(key).add_done_callback(_close_reader)
        for key, desc in self._descriptors.items():
            if key not in self._open and key not in self._opening and self._readable(desc):
                self._opening[key] = _open_in_background(desc)

    def get(self, pool: PoolKey) -> IndexReader | None:
        """The pool's index, or None: not on this node, none published, or not readable here.
        One still being mapped whole is not waited for (a large pool's index takes seconds, and
        a process forked meanwhile lacks the thread): it is mapped here as usual, and the
        whole mapping closed once made."""
        if pool in self._open:
            return self._open[pool]
        desc = self._descriptors.get(pool)
        opening = self._opening.pop(pool, None)
        if opening is not None and opening.done():
            reader = opening.result()
        else:
            if opening is not None:
                opening.add_done_callback(_close_reader)
            reader = _open_reader(desc, populate=False) if desc is not None and self._readable(desc) else None
        if desc is not None:
            self._open[pool] = reader
        elif reader is not None:
            reader.close()
        return reader

    def _readable(self, desc: PoolDescriptor) -> bool:
        return bool(ORDERED_LOADS and desc.index_path and self._node_id is not None and desc.node_id == self._node_id)

    def locate(self, pool: PoolKey, keys: Sequence[bytes]) -> Found | None:
        """Per key, its entry in ``pool``'s published index (unpinned: validate the copy), and
        which keys the index could not answer (ask the shard); None when this process cannot
        read that index."""
        reader = self.get(pool)
        listable = all(map(KEY_BYTES.__eq__, map(len, keys)))
        return reader.lookup(keys) if reader is not None and keys and listable else None

    def generation_of(self, pool: PoolKey, key: bytes) -> int | None:
        """``locate`` of one key: the generation ``pool``'s index lists for it (0: none), or None
        when this process cannot read that index or it cannot say."""
        reader = self.get(pool)
        return reader.generation_of(key) if reader is not None and len(key) == KEY_BYTES else None

    def stale(self, locations: Locations, keys: Sequence[bytes], rows: np.ndarray) -> tuple[np.ndarray, set[PoolKey]]:
        """Of copies made from unpinned entries (``rows`` of ``locations``, whose keys are
        ``keys``), which entries are no longer listed with that generation (evicted or replaced
        meanwhile: the bytes may be another entry's), and the pools whose index this process
        cannot read (nothing read from them unpinned can be trusted, so their copies are stale
        too). A key that is not a digest cannot be checked: stale."""
        stale: np.ndarray = np.zeros(len(rows), dtype=bool)
        unreadable: set[PoolKey] = set()
        for index, pool in enumerate(locations.pools):
            sel = np.flatnonzero(locations.pool[rows] == index)
            if not len(sel):
                continue
            reader = self.get(pool)
            if reader is None:
                unreadable.add(pool)
            pool_keys = [keys[row] for row in rows[sel].tolist()]
            if reader is None or not all(map(KEY_BYTES.__eq__, map(len, pool_keys))):
                stale[sel] = True
            else:
                stale[sel] = ~reader.validate(pool_keys, locations.generation[rows[sel]])
        return stale, unreadable

    def close(self) -> None:
        self.sync({})


def _open_in_background(desc: PoolDescriptor) -> Future[IndexReader | None]:
    """``_open_reader`` on a thread of its own (``mmap`` releases the GIL while it maps): a
    thread per index, not a pool of them, so a process forked meanwhile inherits no executor
    whose thread it lacks."""
    opened: Future[IndexReader | None] = Future()

    def run() -> None:
        reader = None
        try:
            reader = _open_reader(desc, populate=True)
        finally:
            opened.set_result(reader)  # whatever happened: nothing waits on it for ever

    threading.Thread(target=run, name="ucm-ray-index", daemon=True).start()
    return opened


def _open_reader(desc: PoolDescriptor, *, populate: bool) -> IndexReader | None:
    """The pool's index (``_readable`` said it publishes one), or None."""
    try:
        return IndexReader(desc.index_path or "", desc.incarnation, populate=populate)
    except Exception as e:  # noqa: BLE001 -- on its own thread too: whatever failed, lookups go through Ray
        log.warning("shard %s: its published index is not readable here (%s); looking up through Ray",
                    desc.shard_id, e)
        return None


def _close_reader(opened: Future[IndexReader | None]) -> None:
    """A mapping made for a pool that left meanwhile."""
    reader = opened.result()
    if reader is not None:
        reader.close()
