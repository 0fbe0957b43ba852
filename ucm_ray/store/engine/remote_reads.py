"""RemoteReads: which entries this engine loaded from another node's pool, and how often.

Under writer-local placement a block's bytes stay on its writer's node, so every reader of a
hot document on other nodes loads it from that one pool (the hot-spot ratio of bytes served:
docs/scaling.md, design (k)). An engine that loads the same entry from another node again keeps
a copy in its own node's pool, registered as a write: the next readers on its node find it
locally, and other nodes' readers are told of the copy beside the original. Counting reads
before copying keeps one-off reads from filling pools with copies nobody asks for again.
"""

from __future__ import annotations

from collections.abc import Sequence

REMEMBERED_READS = 65536
"""Entries whose remote reads are counted at a time, the least recently read out first: a
32-byte key and its count cost ~150 bytes here, ~10 MB in all; a read older than this many
other entries' counts as a first read again."""


class RemoteReads:
    """Read counts of entries loaded from other nodes, bounded (least recently read out)."""

    def __init__(self, copy_at: int, capacity: int = REMEMBERED_READS) -> None:
        """``copy_at``: the read of an entry from another node that keeps a copy (1: the first;
        0: never)."""
        self._copy_at = copy_at
        self._capacity = capacity
        self._reads: dict[bytes, int] = {}

    def count(self, keys: Sequence[bytes]) -> list[bool]:
        """Count one more read of each of ``keys`` (loaded from another node); per key, whether
        this read is the one that keeps a copy (its count then starts over)."""
        if not self._copy_at:
            return [False] * len(keys)
        reads = self._reads
        out = []
        for key in keys:
            seen = reads.pop(key, 0) + 1
            copy = seen >= self._copy_at
            if not copy:
                reads[key] = seen  # re-inserted: most recently read last
            out.append(copy)
        while len(reads) > self._capacity:
            del reads[next(iter(reads))]
        return out

    def __len__(self) -> int:
        return len(self._reads)
