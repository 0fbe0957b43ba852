"""A shard's index, published read-only in shared memory: the writer's side (the shard's).

A lookup through Ray costs a round trip (~1 ms here, several on a busy host),
and a store-warm prompt pays it before vLLM may schedule it. But on one node
the shard and its readers share memory: the shard keeps a copy of its
key -> entry map in a ``/dev/shm`` file that readers map read-only
(``store.engine.published_reader``), so a miss is answered in microseconds and a
hit needs no pin. Every entry listed gets a generation, unique within one
incarnation of the shard, that readers validate their copies against; a slot is
unlisted here before the shard can grant it to anyone. The table's layout and its
concurrency rules are in ``store.published_layout``.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ucm_ray.keys import KEY_BYTES
from ucm_ray.store.published_layout import (
    BUCKET,
    EMPTY,
    HEADER,
    MAGIC,
    MAX_LOAD,
    ON_DISK,
    TOMBSTONE,
    index_bytes,
    key_halves,
    table_buckets,
)
from ucm_ray.store.types import NO_CHECKSUM

log = logging.getLogger(__name__)


class PublishedIndex:
    """The shard's side: a table it alone writes (called under the shard's lock)."""

    def __init__(self, path: str, pool_bytes: int, incarnation: int, disk_bytes: int = 0) -> None:
        """``disk_bytes``: the shard's disk tier, whose keys are listed too."""
        self.path = path
        self.buckets = table_buckets(pool_bytes, disk_bytes)
        size = index_bytes(pool_bytes, disk_bytes)
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

    def memory(self) -> mmap.mmap:
        """The table's memory (header and buckets), for the shard to export to other nodes.
        Views of it must be dropped before ``close``."""
        return self._mmap

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
        lo, hi = (int(w) for w in key_halves([key])[0])
        at = lo & self._mask
        while self._table["generation"][at] not in (EMPTY, TOMBSTONE):
            at = (at + 1) & self._mask
        if self._table["generation"][at] == TOMBSTONE:
            self._tombstones -= 1
        self._write(at, (lo, hi, offset, size, self._generation, NO_CHECKSUM if checksum is None else checksum))
        self._where[key] = at
        return self._generation

    def publish_on_disk(self, key: bytes, size: int) -> int:
        """List a key that only the disk tier holds (offset ``ON_DISK``): a reader that finds it
        asks the shard instead of answering "absent"; its generation, 0 when not listed."""
        return self.publish(key, ON_DISK, size, None)

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
