"""Writer-local lookups and hints: finding a prompt's blocks wherever their writers put them.

With ``placement: writer_local`` a block lives on its writer's node, so a lookup first reads
this node's shards (their published indexes: no call), then asks the owner of the prompt's
family root where the rest is (one call for the whole prompt, see ``shard.hints``; a leading hot
prefix is found through the fleet's table instead, ``store.hot_prefixes``), then finds
those blocks in the named pools' published indexes, read over NIXL (``remote_index``: no call,
no pin); only what such a read cannot settle is pinned through a call, as any lookup does.
Writers tell the root's owners what they committed (``HintPoster``), after the commit and
without waiting.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ucm_ray.store.engine.acquire import Acquire
from ucm_ray.store.engine.calls import Fanout, ShardAccess
from ucm_ray.store.hot_copy_relay import HotCopies, steward_key
from ucm_ray.store.pool_load import pick_two
from ucm_ray.store.types import Pending, Publishes, ReadLease, ShardRecord
from ucm_ray.transport.base import PoolKey

HOT_READS = 1 << 30
"""What a hot prefix's block counts as read before (``ReadLease.earlier_reads``): the fleet's table
lists it because many asked, so a reader that loads it from another node keeps a copy at once (the
pools the table names would otherwise serve every node), unless the table names as many pools
for it as ``copy_bound`` allows."""


ENOUGH_COPIES = -1
"""What a block counts as read before (``ReadLease.earlier_reads``) when the root's owner already
names as many pools for it as ``copy_bound`` allows: no reader keeps another copy of it."""


READ_POOLS = 4
"""A block's pools a lookup tries at most, members only, in the order named (a hot block's from the
one its node picks, ``spread``): a plain miss on one is final and a failure moves to the next, so
more only cost the scheduler's Python per lookup (and ``Acquire``'s per column). A hot prefix's
row names up to ``copy_bound`` pools (100 at 1,000 nodes): a 128-block hot prefix's lookup took
~2.8 ms of this step's Python with all of them, ~0.9-1.7 ms with 4 (docs/performance-log.md, review54)."""


SPREAD_COPIES_FROM = 4
"""A root's owner names a block's pools most recent first, at most 4 (``shard.hints``'s
``MAX_POOLS_PER_KEY``); once it names that many (a block copied widely: a popular document),
a reader starts at the one a hash of its node picks (``spread_copies``). Bounded by the copy
bound, popular copies stop, and the last one made would serve every later reader: in the
simulation's small popular-document run (200 nodes) the hottest node's bytes were 24.7x the mean
newest-first, 19.0x spread (unbounded copies: 18.8x), docs/scaling.md, stop 55."""


def mark_enough_copies(earlier: np.ndarray, rows: Sequence[int], named: Sequence[int], bound: int) -> None:
    """Rows whose key the root's owner named ``bound`` pools or more for (``named``, per row of
    ``rows``) count as ``ENOUGH_COPIES`` in ``earlier`` (every row when the bound is 1: the
    writer's pool is enough)."""
    if bound <= 0:
        return
    crowded = [row for row, count in zip(rows, named) if count >= bound]
    earlier[crowded] = ENOUGH_COPIES


class FamilyAcquire(Pending[ReadLease]):
    """A lookup in three steps, each posted when the one before has answered: this node's shards
    (``local``, an ``Acquire`` over the writer-local owners), the family root's owner for what
    they lack (``where``), then an ``Acquire`` over the pools it names (their indexes read over
    NIXL where exported). Every miss of a step is a miss, never an error: a root owner that fails
    or never heard of the family leaves the local finds."""

    def __init__(self, access: ShardAccess, keys: list[bytes], pin: Collection[PoolKey],
                 shards: tuple[ShardRecord, ...], local: Acquire, root_owners: list[ShardRecord],
                 hot_pools: Sequence[tuple[PoolKey, ...]] = (), family: Sequence[bytes] = (),
                 reader: str = "", copy_bound: int = 0, recompute_bytes_s: float = 0.0, nodes: int = 0,
                 load: Mapping[PoolKey, float] | None = None) -> None:
        """``hot_pools``: per leading row that is a hot prefix (``store.hot_prefixes``), the pools
        the table names for it (those rows are never asked about); ``family``: the chain from the
        family root on, shown to the root's owner (what its hot-prefix learner counts);
        ``reader``: this node's id (the root's owner counts each node's reads of each block:
        ``ReadLease.earlier_reads``); ``copy_bound``: pools named for a block past which it is
        not copied (``copy_bound()``; 0: none), and the root's owner's bound on the readers it
        tells a block is popular (``shard.remote_reads``); ``recompute_bytes_s``: the asker's
        prefill rate (``BlockStore.acquire``), sent to the pools it names too; ``nodes``: the
        fleet's nodes as this engine's membership has them (the root's owner's hot-prefix learner
        counts distinct askers against a share of them, ``hot_prefixes.askers_needed``); ``load``:
        the most loaded pools' figures the directory pushed (``store.pool_load``; none: a hot row's
        pools in ``spread``'s order), by which a hot row's reader picks the less loaded of two."""
        self._access = access
        self._keys = keys
        self._pin = pin
        self._shards = shards
        self._local = local
        self._root_owners = root_owners
        self._hot_pools = hot_pools
        self._family = family
        self._reader = reader
        self._copy_bound = copy_bound
        self._nodes = nodes
        self._recompute_bytes_s = recompute_bytes_s
        self._load = load or {}
        self._missing: np.ndarray | None = None  # rows the local step did not find
        self._asked: np.ndarray = np.zeros(0, dtype=np.int64)  # of those, the rows the root's owner is asked about
        self._where: Fanout[tuple[list[tuple[PoolKey, ...]], list[int]] | None] | None = None
        self._remote: Acquire | None = None
        self._remote_rows: np.ndarray | None = None

    def poll(self) -> bool:
        if self._missing is None:
            if not self._local.poll():
                return False
            self._ask_where()
        if self._where is not None and self._remote_rows is None:
            if not self._where.poll():
                return False
            self._pin_where(self._where.result())
        return self._remote is None or self._remote.poll()

    def result(self) -> ReadLease:
        if self._missing is None:
            self._local.result()
            self._ask_where()
        if self._where is not None and self._remote_rows is None:
            self._pin_where(self._where.result())
        lease = self._local.result()
        if self._remote is not None and self._remote_rows is not None:
            lease.merge(self._remote_rows, self._remote.result())
            self._remote = None
        return lease

    def _ask_where(self) -> None:
        lease = self._local.result()
        missing = self._missing = np.flatnonzero(~lease.locations.found())
        self._asked = missing[missing >= len(self._hot_pools)]
        owner = next((rec for rec in self._root_owners if not self._access.suspects.suspect(rec)), None)
        if not len(self._asked) or owner is None:
            self._pin_where(None)  # the hot rows, if any: their pools come with the table
            return
        keys = [self._keys[i] for i in self._asked.tolist()]
        posted = self._access.poster.post(owner.handle.where, owner.pool.incarnation, keys, self._family,
                                          self._reader, self._copy_bound, self._nodes)
        self._where = Fanout(self._access, [(owner, posted)], lambda answers: answers[0])
        lease.calls += 1

    def _pin_where(self, answer: tuple[list[tuple[PoolKey, ...]], list[int]] | None) -> None:
        """Look each missing key up on the pools named for it (the hot-prefix table's, or the
        root owner's answer) that are still members."""
        assert self._missing is not None
        self._remote_rows = np.zeros(0, dtype=np.int64)
        draw = random.getrandbits(62)  # one pair per lookup: a prefix's rows read from one pool
        ordered: dict[int, Sequence[PoolKey]] = {}  # per row object: a prefix's rows mostly share theirs

        def order(pools: Sequence[PoolKey]) -> Sequence[PoolKey]:
            got = ordered.get(id(pools))
            if got is None:
                got = ordered[id(pools)] = pick_two(spread(pools, self._reader), self._load, draw)
            return got

        named = {row: order(self._hot_pools[row]) for row in self._missing.tolist() if row < len(self._hot_pools)}
        earlier: np.ndarray = np.zeros(len(self._keys), dtype=np.int64)
        earlier[:len(self._hot_pools)] = HOT_READS
        at = {rec.key: i for i, rec in enumerate(self._shards)}
        mark_enough_copies(earlier, range(len(self._hot_pools)), _members(self._hot_pools, at), self._copy_bound)
        if answer:
            pools, earlier_reads = answer
            earlier[self._asked] = earlier_reads
            named.update(zip(self._asked.tolist(), (spread_copies(row, self._reader) for row in pools)))
            mark_enough_copies(earlier, self._asked.tolist(), _members(pools, at), self._copy_bound)
        self._local.result().earlier_reads = earlier  # the lease ``result`` returns
        if not named:
            return
        candidates = _fewest_sources(read_candidates([named.get(row, ()) for row in self._missing.tolist()], at))
        rows = [i for i, found in enumerate(candidates) if found]
        if not rows:
            return
        width = max(len(candidates[i]) for i in rows)
        # a row shorter than the widest repeats its last pool: ``Acquire`` only moves down a row
        owners = np.asarray([candidates[i] + candidates[i][-1:] * (width - len(candidates[i])) for i in rows],
                            dtype=np.int64)
        self._remote_rows = self._missing[rows]
        self._remote = Acquire(self._access, [self._keys[i] for i in self._remote_rows.tolist()], self._pin,
                               self._shards, owners, self._recompute_bytes_s)


def spread(pools: Sequence[PoolKey], reader: str) -> Sequence[PoolKey]:
    """A hot block's pools in the order ``reader``'s node tries them: from the one a hash of the
    node picks, so the nodes reading a hot prefix share the pools the table names (its first
    pool would otherwise serve them all: docs/scaling.md, stop 54). Every block of one prefix
    named by the same pools starts at the same one (one source per prompt where it can)."""
    if len(pools) < 2:
        return pools
    start = zlib.crc32(reader.encode()) % len(pools)
    return tuple(pools[start:]) + tuple(pools[:start])


def spread_copies(pools: Sequence[PoolKey], reader: str) -> Sequence[PoolKey]:
    """A root's owner's pools for a block (most recent first), in the order ``reader``'s node tries
    them: as named while fewer than ``SPREAD_COPIES_FROM`` (the most recent writer holds the
    longest prefix, and is its pool's most recently used), else ``spread``."""
    return spread(pools, reader) if len(pools) >= SPREAD_COPIES_FROM else pools


def read_candidates(named: Sequence[Sequence[PoolKey]], at: Mapping[PoolKey, int]) -> list[list[int]]:
    """Per row, the first ``READ_POOLS`` of the pools named for it that are members, in order, as
    indices (``at``: a member's index); looked at no further than needed."""
    out = []
    for pools in named:
        row: list[int] = []
        for pool in pools:
            index = at.get((pool[0], pool[1]))  # a list, from a root's owner
            if index is not None:
                row.append(index)
                if len(row) == READ_POOLS:
                    break
        out.append(row)
    return out


def _members(named: Sequence[Sequence[PoolKey]], members: Collection[PoolKey]) -> list[int]:
    """Per row, how many of the pools named for it are members (a departed pool holds nothing);
    counted once per distinct row (a hot prefix's rows mostly name the same pools, up to the copy
    bound each)."""
    counted: dict[tuple, int] = {}
    out = []
    for pools in named:
        row = tuple(map(tuple, pools))
        count = counted.get(row)
        if count is None:
            count = counted[row] = sum(map(members.__contains__, row))
        out.append(count)
    return out


def _fewest_sources(candidates: list[list[int]]) -> list[list[int]]:
    """Each key's pools, reordered so that consecutive keys share a pool where they can: a key
    that the previous key's first pool also holds is pinned there, else at its most recent
    writer's. A prefix copied whole by a later writer is then pinned in one call, not one per
    pool that once registered part of it."""
    previous: int | None = None
    out = []
    for pools in candidates:
        if previous in pools and pools[0] != previous:
            pools = [previous] + [pool for pool in pools if pool != previous]
        out.append(pools)
        previous = pools[0] if pools else None
    return out


class HintPoster:
    """Tells the owners of each committed block's family root which pool now holds it: one
    ``register_hints`` call per (root owner, pool), posted and never awaited (a lost hint is a
    miss for readers on other nodes, nothing worse). A hot prefix's copies (``NO_HINT`` rows)
    are announced instead (``_announce``): to a steward shard that relays them to the directory
    (``store.hot_copy_relay``), or to the directory itself, whose table then names their pools."""

    def __init__(self, access: ShardAccess, directory: Callable[[], Any] | None = None, node: str = "",
                 relay: bool = True) -> None:
        """``directory``: the directory actor's handle now, or None (a hot prefix's copies are then
        told to nobody: the table keeps naming the pools it named); ``node``: this writer's node
        id, told with each registration (a popular block's copy holds its place at the root's
        owner: ``shard.remote_reads``); ``relay``: a hot prefix's copies go through a steward
        (``relay_hot_copies``)."""
        self._access = access
        self._directory = directory
        self._node = node
        self._relay = relay

    def post(self, publish: Publishes, visible: Sequence[bool],
             root_owners: Callable[[Sequence[bytes]], list[list[ShardRecord]]]) -> None:
        """``root_owners``: the owners of each family root (and of a relayed announcement's
        steward key). A row whose family is empty (``NO_HINT``: a hot prefix's copy) registers
        nothing at any root: it is announced."""
        batches: dict[tuple[PoolKey, PoolKey], tuple[ShardRecord, list[bytes]]] = {}
        pools = publish.locations.pools
        families = publish.family_keys()
        rows: list[int] = []
        copied: list[int] = []
        for row, shown in enumerate(visible):
            if shown:
                (rows if families[row] else copied).append(row)
        if copied:
            self._announce(publish, copied, root_owners)
        for row, owners in zip(rows, root_owners([families[row] for row in rows]) if rows else []):
            key = publish.keys[row]
            pool = pools[int(publish.locations.pool[row])]
            for owner in owners:
                batches.setdefault((owner.key, pool), (owner, []))[1].append(key)
        for (_, pool), (owner, keys) in batches.items():
            self._access.poster.post(owner.handle.register_hints, owner.pool.incarnation, pool, keys, self._node)

    def _announce(self, publish: Publishes, rows: list[int],
                  root_owners: Callable[[Sequence[bytes]], list[list[ShardRecord]]]) -> None:
        """One call for these rows (a hot prefix's copies), posted: to the steward, the first owner
        of ``steward_key`` that is not a suspect, or to the directory (relay off, or no steward)."""
        pools = publish.locations.pools
        copies: HotCopies = {}
        for row in rows:
            copies.setdefault(pools[int(publish.locations.pool[row])], []).append(publish.keys[row])
        if self._relay:
            owners = root_owners([steward_key([publish.keys[rows[0]]])])[0]
            steward = next((rec for rec in owners if not self._access.suspects.suspect(rec)), None)
            if steward is not None:
                self._access.poster.post(steward.handle.relay_hot_copies, steward.pool.incarnation, copies)
                return
        directory = self._directory() if self._directory is not None else None
        if directory is not None:
            self._access.poster.post(directory.announce_hot_copies, copies)
