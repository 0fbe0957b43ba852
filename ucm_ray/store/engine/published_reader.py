"""Same-node lookups in shards' published indexes, without a Ray call: the readers' side.

A shard lists its committed entries in a shared-memory table
(``store.shard.published_writer``; layout and concurrency rules in
``store.published_layout``) that readers on its node map read-only.

Pins are replaced by *validation*. Every published entry has a generation,
unique within one incarnation of the shard. A reader notes it at lookup,
copies the bytes without a pin, then looks the key up again: the same
generation means the entry stayed listed the whole time, so its slot was never
freed, never handed to a writer, and the bytes copied are the entry's (a slot
is unlisted before the shard can grant it to anyone). Another generation
or none is a failed load (vLLM recomputes, ``get`` reports a miss): never wrong
bytes. Readers tell the shard what they read, off the critical path
(``CacheShard.touch``, through ``store.engine.touches``), so read entries stay
recently used and are evicted last.
"""

from __future__ import annotations

import logging
import mmap
import platform
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import numpy as np

from ucm_ray.keys import KEY_BYTES
from ucm_ray.store.engine.remote_index import RemoteIndexReader
from ucm_ray.store.published_layout import BUCKET, EMPTY, HEADER, MAGIC, ON_DISK, TOMBSTONE, key_halves
from ucm_ray.store.types import NO_CHECKSUM, Found, Locations
from ucm_ray.transport.base import PoolDescriptor, PoolKey

log = logging.getLogger(__name__)

ORDERED_LOADS = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
"""Whether this CPU keeps plain loads and stores in order, as the seqlocks need (x86)."""


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
        words = key_halves(keys)
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
            _, key_lo, key_hi, offset, _, generation, _, _ = self._table[at].item()
            if before & 1 or int(seqs[at]) != before:
                return None  # mid-update: the vectorized lookup reads it again, or asks the shard
            if generation == EMPTY:
                answer = 0 if complete else None
                break
            if generation != TOMBSTONE and key_lo == lo and key_hi == hi:
                answer = None if offset == ON_DISK else generation  # on disk: the shard's acquire says
                break
            at = (at + 1) & mask
        return answer if int(self._header["epoch"][0]) == epoch else None

    def validate(self, keys: Sequence[bytes], generations: np.ndarray, offsets: np.ndarray,
                 sizes: np.ndarray) -> np.ndarray:
        """Per key, whether the entry of that generation is still listed (its copy is good); a
        generation is unique within an incarnation, so offsets and sizes cannot differ here
        (they matter to ``RemoteIndexReader``, whose reads are not seqlocked)."""
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
        disk: np.ndarray = np.zeros(n, dtype=bool)
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
            listed = steady & live & (rows["key_lo"] == lo[todo]) & (rows["key_hi"] == hi[todo])
            on_disk = listed & (rows["offset"] == ON_DISK)  # not a hit here: the shard promotes it
            hit = listed & ~on_disk
            known[todo[on_disk]] = False
            disk[todo[on_disk]] = True
            miss = steady & (gen == EMPTY)
            found = todo[hit]
            generation[found] = gen[hit]
            offset[found] = rows["offset"][hit]
            size[found] = rows["size"][hit]
            checksum[found] = rows["checksum"][hit]
            known[todo[miss]] = complete
            step = steady & ~hit & ~miss  # another key or a tombstone: the chain goes on
            at[todo[step]] = (at[todo[step]] + np.uint64(1)) & self._mask
            settled = listed | miss
            if not steady.all():  # torn reads are read again, a few times: a bucket left
                torn_rounds += 1  # mid-update by a shard that paused or died stays unanswered
                if torn_rounds > self.RETRIES:
                    known[todo[~steady]] = False
                    settled |= ~steady
            todo = todo[~settled]
        known[todo] = False
        return Found(generation, offset, size, checksum, known, disk)


class IndexReaders:
    """One process's readers of the published indexes it can read: pools on its own node that
    publish one, mapped, on a CPU whose ordering the seqlocks rely on; with ``remote``, pools on
    other nodes that export theirs over NIXL (``RemoteIndexReader``). Synced with membership
    like ``PoolConnections``: an old incarnation's reader is closed before anything reads it."""

    def __init__(self, node_id: str | None, *, remote: bool = False) -> None:
        """``node_id``: this process's node (None: read no index, every lookup is a call);
        ``remote``: also read other nodes' exported indexes over NIXL."""
        self._node_id = node_id
        self._remote = remote and node_id is not None
        self._descriptors: dict[PoolKey, PoolDescriptor] = {}
        self._open: dict[PoolKey, IndexReader | RemoteIndexReader | None] = {}
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

    def get(self, pool: PoolKey) -> IndexReader | RemoteIndexReader | None:
        """The pool's index, or None: not on this node, none published, or not readable here.
        One still being mapped whole is not waited for (a large pool's index takes seconds, and
        a process forked meanwhile lacks the thread): it is mapped here as usual, and the
        whole mapping closed once made."""
        if pool in self._open:
            return self._open[pool]
        desc = self._descriptors.get(pool)
        if desc is not None and self._remote_readable(desc):
            self._open[pool] = _open_remote(desc)
            return self._open[pool]
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

    def _remote_readable(self, desc: PoolDescriptor) -> bool:
        return self._remote and desc.index_bytes > 0 and desc.node_id != self._node_id

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
                at = rows[sel]
                stale[sel] = ~reader.validate(pool_keys, locations.generation[at], locations.offset[at],
                                              locations.size[at])
        return stale, unreadable

    def close(self) -> None:
        self.sync({})


def _open_remote(desc: PoolDescriptor) -> RemoteIndexReader | None:
    """A reader of another node's exported index, or None where NIXL cannot reach it (then
    lookups of that pool ask its shard, as without remote reads)."""
    try:
        return RemoteIndexReader(desc)
    except Exception as e:  # noqa: BLE001 -- NIXL missing or the agent unreachable: calls instead
        log.info("ucm-ray: shard %s's index is not readable from this node (%s): lookups ask it",
                 desc.shard_id, e)
        return None


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
