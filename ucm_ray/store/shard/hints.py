"""FamilyHints: which pools hold blocks that were written on other nodes (writer-local placement).

With ``placement: writer_local`` a block's bytes stay in a pool on its writer's node, so a
reader elsewhere cannot compute where they are. Every writer therefore tells the owner of the
prompt's *family root* (the prompt's first block key: ``owners(root)``) which pool holds each
block it committed; a reader asks that one shard about all of its prompt's blocks in one call,
then pins them where they are. A prompt's blocks share its root, so one call answers for a
prompt of any length.

A hint is only a hint: the pool it names is asked to pin the key, and that pool's index, with
its incarnation fencing, generation and checksum rules, decides what a reader gets. A stale
hint (the block evicted there, the pool restarted) costs a wasted pin call and is a miss,
never wrong bytes; hints are therefore not removed when their block is evicted, only aged out
(least recently registered or asked first) when the table is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from ucm_ray.transport.base import PoolKey

HintPools = tuple[PoolKey, ...]
"""The pools a hint names for a key."""

MAX_POOLS_PER_KEY = 4
"""Pools remembered per key (the most recent): copies beyond a few add pin calls, not hits."""


class FamilyHints:
    """Key -> the pools that registered it, most recent last; bounded, least recently used out."""

    def __init__(self, max_keys: int) -> None:
        self._max_keys = max_keys
        self._pools: OrderedDict[bytes, HintPools] = OrderedDict()
        self.registered = 0
        self.adopted = 0
        self.asked = 0
        self.answered = 0

    def register(self, pool: PoolKey, keys: Sequence[bytes]) -> None:
        """``pool`` now holds ``keys`` (committed there)."""
        for key in keys:
            self._add(key, (pool,))
        self.registered += len(keys)
        self._bound()

    def adopt(self, entries: Mapping[bytes, Sequence[PoolKey]]) -> None:
        """Another root's owner handed these over (their family root moved here when a prefix
        became hot): each key's pools, most recent first, as ``where`` gave them."""
        for key, pools in entries.items():
            self._add(key, tuple((pool[0], pool[1]) for pool in reversed(pools)))
        self.adopted += len(entries)
        self._bound()

    def _add(self, key: bytes, pools: HintPools) -> None:
        """``pools`` (oldest first) now hold ``key``: the most recent last, the key the newest."""
        known = self._pools.pop(key, ())
        self._pools[key] = (tuple(p for p in known if p not in pools) + pools)[-MAX_POOLS_PER_KEY:]

    def _bound(self) -> None:
        while len(self._pools) > self._max_keys:
            self._pools.popitem(last=False)

    def where(self, keys: Sequence[bytes]) -> list[HintPools]:
        """Per key, the pools that said they hold it, most recent first (empty: none)."""
        table = self._pools
        out: list[HintPools] = []
        for key in keys:
            pools = table.get(key)
            if pools is None:
                out.append(())
                continue
            table.move_to_end(key)
            out.append(pools[::-1])
        self.asked += len(keys)
        self.answered += sum(1 for pools in out if pools)
        return out

    def peek(self, keys: Sequence[bytes]) -> list[HintPools]:
        """As ``where``, without counting an ask or refreshing the keys' age."""
        return [self._pools.get(key, ())[::-1] for key in keys]

    def stats(self) -> dict[str, int]:
        return {"hints": len(self._pools), "hints_registered": self.registered, "hints_adopted": self.adopted,
                "hints_asked": self.asked,
                "hints_answered": self.answered}

    def __len__(self) -> int:
        return len(self._pools)
