"""Another node's published index, read one-sidedly over NIXL: lookups without a Ray call.

A shard exports its published index (``store.published_layout``) with its pool's NIXL agent.
A reader on another node reads, per key, the window of buckets its probe chain starts with
(``WINDOW``; one that runs past the table's end goes on at its start, as the chain does) and the
table's header, in one transfer, and answers as a same-node reader does:
an entry's location and generation, read unpinned. The copy of its bytes is then validated by
reading the key's window again: the copy counts only if the entry is listed with the same
generation, offset and size afterwards (a slot is unlisted before the shard can hand it to a
writer, so the bytes copied in between are the entry's).

A remote read cannot follow a bucket's seqlock as a local reader does (read the sequence,
then the fields, then the sequence again), so a bucket read while the shard rewrote it may mix
two versions. That costs a miss, never wrong bytes: the validation compares every field the
copy relied on with a second read made after the copy, and a torn first read differs from the
entry's settled state in some field it read wrong. What the window cannot settle (a chain
longer than the window, a table that is not complete, a rebuild or a torn bucket) is left
unknown, and the lookup asks the shard through Ray as before.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

from ucm_ray.store.published_layout import (
    BUCKET,
    EMPTY,
    HEADER,
    MAGIC,
    ON_DISK,
    TOMBSTONE,
    buckets_of,
    key_halves,
)
from ucm_ray.store.types import NO_CHECKSUM, Found
from ucm_ray.transport.base import CopyOp, PoolDescriptor, Ranges

log = logging.getLogger(__name__)

WINDOW = 8
"""Buckets read per key: at the table's load bound (half full) nearly every chain ends within it."""
READ_TIMEOUT_S = 0.25
"""How long a lookup waits for another node's index: past it the lookup asks the shard instead."""


class RemoteIndexReader:
    """Reads one remote shard's published index through a NIXL transport to its exported table."""

    def __init__(self, desc: PoolDescriptor) -> None:
        from ucm_ray.transport.nixl import NixlPoolTransport

        if not desc.index_bytes:
            raise ValueError(f"shard {desc.shard_id} exports no index")
        region = dataclasses.replace(desc, pool_base_addr=desc.index_base_addr, pool_bytes=desc.index_bytes)
        self._transport = NixlPoolTransport(region, default_timeout_s=READ_TIMEOUT_S)
        self._incarnation = desc.incarnation
        self.buckets = buckets_of(desc.index_bytes)  # sized for the pool and the shard's disk tier
        self._mask = np.uint64(self.buckets - 1)
        self._buffer = torch.zeros(0, dtype=torch.uint8)

    def lookup(self, keys: Sequence[bytes]) -> Found | None:
        """Per key, the listed entry as the window read shows it (``known`` False where it
        cannot say); None if the table could not be read or was being rebuilt."""
        read = self._read(keys)
        if read is None:
            return None
        header, windows = read
        n = len(keys)
        found = Found(np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                      np.full(n, NO_CHECKSUM, dtype=np.int64), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
        words = key_halves(keys)
        generation = windows["generation"]
        live = (generation != EMPTY) & (generation != TOMBSTONE)
        match = live & (windows["key_lo"] == words[:, :1]) & (windows["key_hi"] == words[:, 1:])
        torn = (windows["seq"] & np.uint64(1)) == 1
        settles = match | (generation == EMPTY) | torn
        first = np.argmax(settles, axis=1)
        rows = np.arange(n)
        settled = settles[rows, first]
        entries = windows[rows, first]
        listed = settled & match[rows, first] & ~torn[rows, first]
        on_disk = listed & (entries["offset"] == ON_DISK)  # not a hit here: the shard promotes it
        hit = listed & ~on_disk
        miss = settled & (generation[rows, first] == EMPTY) & ~torn[rows, first]
        found.generation[hit] = entries["generation"][hit]
        found.offset[hit] = entries["offset"][hit]
        found.size[hit] = entries["size"][hit]
        found.checksum[hit] = entries["checksum"][hit]
        found.known[hit] = True
        found.known[miss] = bool(header["complete"])
        found.on_disk[on_disk] = True
        return found

    def generation_of(self, key: bytes) -> int | None:
        found = self.lookup([key])
        if found is None or not found.known[0]:
            return None
        return int(found.generation[0])

    def validate(self, keys: Sequence[bytes], generations: np.ndarray, offsets: np.ndarray,
                 sizes: np.ndarray) -> np.ndarray:
        """Per key, whether its entry is still listed exactly as the copy read it."""
        found = self.lookup(keys)
        if found is None:
            return np.zeros(len(keys), dtype=bool)
        return (found.known & (found.generation == generations) & (found.offset == offsets)
                & (found.size == sizes))

    def close(self) -> None:
        self._transport.close()

    def _read(self, keys: Sequence[bytes]) -> tuple[np.void, np.ndarray] | None:
        """The header and each key's window, read in one transfer. A window that runs past the
        table's end is read in two pieces, its tail from the table's start: its chain goes on
        there (before, such a key was unknown, and a prompt with one key whose home was in a
        table's last ``WINDOW - 1`` buckets paid a pin call on the shard for it)."""
        words = key_halves(keys)
        home = (words[:, 0] & self._mask).astype(np.int64)
        span = WINDOW * BUCKET.itemsize
        need = HEADER.itemsize + len(keys) * span
        if self._buffer.numel() < need:
            self._buffer = torch.zeros(max(need, 2 * self._buffer.numel()), dtype=torch.uint8)
            self._transport.register_local(self._buffer)
        buffer = self._buffer
        ops = [CopyOp(0, buffer[:HEADER.itemsize])]
        for i, at in enumerate(home.tolist()):
            start = HEADER.itemsize + i * span
            head = min(WINDOW, self.buckets - at) * BUCKET.itemsize  # the part before the table's end
            ops.append(CopyOp(HEADER.itemsize + at * BUCKET.itemsize, buffer[start:start + head]))
            if head < span:
                ops.append(CopyOp(HEADER.itemsize, buffer[start + head:start + span]))
        try:
            self._transport.read(Ranges.of(ops)).wait(READ_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 -- a dead or slow node: the lookup asks the shard
            log.debug("remote index of %s unreadable: %s", self._transport.desc.shard_id, e)
            # a late completion may still write into this buffer: never reuse it
            self._buffer = torch.zeros(0, dtype=torch.uint8)
            return None
        raw = buffer[:need].numpy()
        header = np.frombuffer(raw[:HEADER.itemsize].tobytes(), dtype=HEADER)[0]
        if (int(header["magic"]) != MAGIC or int(header["incarnation"]) != self._incarnation
                or int(header["epoch"]) & 1):
            return None
        windows = np.frombuffer(raw[HEADER.itemsize:].tobytes(), dtype=BUCKET).reshape(len(keys), WINDOW)
        return header, windows
