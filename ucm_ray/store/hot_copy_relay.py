"""Relayed announcements of readers' hot-prefix copies: a steward shard gathers them, the directory
takes them in one call a window.

A reader that loads a hot prefix's block from another node keeps a copy and tells the directory,
whose table then names its pool (``HotPrefixTable.add_copies``). Told directly, the directory's
node took one call per copying request: at 1,000 nodes 14.8 of its 15.2x the mean calls in the
simulation (docs/scaling.md, stop 57). Relayed, a reader tells a steward instead, the owner (by
rendezvous over the membership, as a family root is placed) of a salted digest of the first block
it copied (``steward_key``), so the copies of one hot prefix gather at one shard and the copies of
different prefixes at different ones; the steward forwards what it gathered to the directory at most once a window
(``PushPacer``: at once when the last forward was a window ago, else when it is), one call
whatever the number of readers. The table, its copy bound and its pushes are unchanged: the same
pools are named, a window later at most.

Faults: a steward that dies loses what it gathered and had not forwarded (one window at most).
A copy is a hint, never bytes: an announcement lost leaves its pool unnamed, so other nodes'
readers load the block from the pools the table does name (bytes on those, or a miss where none
holds it) while the copy's own node still finds it in its published index; a pool that left
before the forward lands is ignored by the directory (it names member pools only); a reader still
validates the key and its generation in the pool's published index after the read, and a pool
key carries its shard's incarnation, so no relay can make a reader take another key's or
incarnation's bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ucm_ray.transport.base import PoolKey

MAX_RELAYED_KEYS = 1 << 16
"""Keys a steward holds for its next forward (2 MiB of 32-byte keys); past it an announcement is
dropped, as a lost one is (the copy bound keeps a hot row at ~100 pools at 1,000 nodes, the
table at ``MAX_HOT_BLOCKS`` rows: a window's copies are far fewer)."""

HotCopies = dict[PoolKey, list[bytes]]
"""Per reader's pool, the hot-prefix blocks it keeps copies of (an announcement, or a forward)."""


STEWARD_SALT = b"hot-copy-steward"
"""Salts the first copied block's key into its steward key: a steward is then placed apart from
the block's own owner."""


def steward_key(copied: Sequence[bytes]) -> bytes:
    """The key whose owner is an announcement's steward: a digest of the first block copied (a hot
    prefix's readers mostly copy it from its first block, so its copies gather at one steward),
    not the block itself. The first block's owner was that prefix's family root's owner until the
    prefix became hot, answering its lookups and hints while it was learned; as its steward too
    it was the fleet's hottest node (1,000 nodes: 6.2x the mean calls, 152 of its 221 calls
    announcements; salted, the hottest is 4.6x: docs/scaling.md, stop 60)."""
    return hashlib.blake2b(copied[0], digest_size=16, person=STEWARD_SALT).digest()


@dataclass
class RelayCounts:
    gathered: int = 0
    """Keys announced to this steward."""
    forwarded: int = 0
    """Forwards made (one directory call each)."""
    dropped: int = 0
    """Keys dropped past ``MAX_RELAYED_KEYS``."""


class HotCopyRelay:
    """A steward's announcements not forwarded yet, in the order they came (a pool first announced
    first, its keys in order, each once). Thread-safe: the shard's calls gather, its forward timer
    takes."""

    def __init__(self, max_keys: int = MAX_RELAYED_KEYS) -> None:
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._held: dict[PoolKey, dict[bytes, None]] = {}
        self._size = 0
        self.counts = RelayCounts()

    def gather(self, copies: HotCopies) -> None:
        """An announcement: ``copies``' pools keep copies of these blocks."""
        with self._lock:
            for pool, keys in copies.items():
                held = self._held.setdefault((pool[0], pool[1]), {})
                for key in keys:
                    self.counts.gathered += 1
                    if key in held:
                        continue
                    if self._size >= self._max_keys:
                        self.counts.dropped += 1
                        continue
                    held[key] = None
                    self._size += 1

    def take(self) -> HotCopies:
        """What was gathered since the last take (then held no more): the next forward."""
        with self._lock:
            held, self._held, self._size = self._held, {}, 0
            if held:
                self.counts.forwarded += 1
        return {pool: list(keys) for pool, keys in held.items() if keys}

    def __len__(self) -> int:
        return self._size
