"""The values both sides of the Ray boundary share: what an engine's client and a shard actor
pass each other, and what the ``BlockStore`` calls take and return.

Plain data and a few constants, nothing that runs: an engine imports this module and
``store/engine/``, a shard actor this module and ``store/shard/``, and neither side imports
the other's folder. Locations, lease ids and slot grants carry the (shard id, incarnation)
they belong to (``blockstore`` tells the fencing rules).
"""

from __future__ import annotations

import operator
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import numpy as np

from ucm_ray.store.hot_prefixes import NO_HOT_PREFIXES, HotPrefixDelta, HotPrefixes
from ucm_ray.store.pool_load import NO_LOAD, LoadFigures
from ucm_ray.transport.base import PoolDescriptor, PoolKey

if TYPE_CHECKING:
    from ray.actor import ActorHandle

DIRECTORY_NAME = "ucm_ray_directory"
"""The shard directory's actor name in the fleet's Ray namespace (clients look it up by it)."""


def random_id() -> int:
    """A fresh random 63-bit id (never 0): guessing or reusing one across restarts is hopeless."""
    return secrets.randbits(63) or 1


class WrongIncarnation(RuntimeError):
    """A call meant for another start of this shard (the client's membership is stale)."""


@dataclass(frozen=True)
class Slot:
    """Where a committed entry's bytes live in the pool."""

    offset: int
    size: int
    checksum: int | None = None


@dataclass(frozen=True)
class Found:
    """A published index's answer to a lookup, per key: ``generation`` 0 is a miss; ``known``
    False means the table could not say (it is incomplete and the key is not in it, or the key
    is ``on_disk``): ask the shard."""

    generation: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    checksum: np.ndarray
    known: np.ndarray
    on_disk: np.ndarray
    """Listed as held by the shard's disk tier only (``known`` is False for these)."""


T = TypeVar("T")


class Location(NamedTuple):
    """Where one key's entry lives: a slot of one incarnation of one shard's pool. A tuple, not a
    frozen dataclass: a lookup makes one per block found (1,024 for a 16k-token prompt), and a
    frozen dataclass cost ~4 us each to build and to hash here, a tuple a tenth of that."""

    shard_id: str
    incarnation: int
    offset: int
    size: int
    checksum: int | None = None
    """The checksum (``store.checksum``) taken by the writer at commit, a property of the entry:
    every reader verifies it."""
    generation: int = 0
    """Nonzero: found in the shard's published index, unpinned; a copy from it counts only if
    the same generation is still listed afterwards (``store.engine.published_reader``). 0: pinned by a lease."""

    @property
    def pool(self) -> PoolKey:
        return (self.shard_id, self.incarnation)


NO_CHECKSUM = -1
"""``Locations.checksum`` of an entry committed without one (a checksum is never negative)."""


@dataclass(eq=False)
class Locations:
    """Entries' locations as columns, row i being the i-th key's (``pool`` -1: a miss).

    A lookup of a 16k-token prompt finds ~1,000 entries per rank, and the hit count, the load
    plan, the worker's copies and its validation all walk them: as arrays, none of those passes
    costs Python per entry (objects cost ~1 us per entry per pass, and a store hit made six
    passes). ``locations[i]`` and iteration give ``Location`` tuples, for callers that take a
    few."""

    pools: list[PoolKey]
    pool: np.ndarray  # int32: index into ``pools``, -1 a miss
    offset: np.ndarray  # int64
    size: np.ndarray  # int64
    checksum: np.ndarray  # int64: the entry's checksum, or NO_CHECKSUM
    generation: np.ndarray  # uint64: 0 pinned, else unpinned (see ``Location.generation``)

    @classmethod
    def missing(cls, n: int) -> Locations:
        """``n`` misses, to be filled with ``put``."""
        return cls([], np.full(n, -1, dtype=np.int32), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                   np.full(n, NO_CHECKSUM, dtype=np.int64), np.zeros(n, dtype=np.uint64))

    @classmethod
    def of(cls, items: Sequence[Location | None]) -> Locations:
        out = cls.missing(len(items))
        for i, loc in enumerate(items):
            if loc is not None:
                out.put([i], loc.pool, [loc.offset], [loc.size],
                         [NO_CHECKSUM if loc.checksum is None else loc.checksum], [loc.generation])
        return out

    def put(self, rows: Sequence[int] | np.ndarray, pool: PoolKey, offset: Sequence[int] | np.ndarray,
            size: Sequence[int] | np.ndarray, checksum: Sequence[int] | np.ndarray,
            generation: Sequence[int] | np.ndarray | int = 0) -> None:
        """Rows ``rows`` are found in ``pool`` at these offsets (``checksum``: NO_CHECKSUM where none)."""
        if pool not in self.pools:
            self.pools.append(pool)
        self.pool[rows] = self.pools.index(pool)
        self.offset[rows] = offset
        self.size[rows] = size
        self.checksum[rows] = checksum
        self.generation[rows] = generation

    def put_found(self, rows: Sequence[int], pool: PoolKey, found: Found) -> list[int]:
        """Rows ``rows`` as a published index of ``pool`` answered for them (``found``, in the same
        order; its misses stay misses). Returns the positions in ``rows`` it found."""
        hit = np.flatnonzero(found.generation)
        self.put(np.asarray(rows, dtype=np.int64)[hit], pool, found.offset[hit], found.size[hit], found.checksum[hit],
                 found.generation[hit])
        return hit.tolist()

    def put_slots(self, rows: Sequence[int], pool: PoolKey, slots: Sequence[Slot | None]) -> None:
        """Rows ``rows`` as a shard of ``pool`` answered for them (pinned slots, None a miss)."""
        hits = [(row, slot) for row, slot in zip(rows, slots) if slot is not None]
        self.put([row for row, _ in hits], pool, [slot.offset for _, slot in hits], [slot.size for _, slot in hits],
                 [NO_CHECKSUM if slot.checksum is None else slot.checksum for _, slot in hits])

    def found(self) -> np.ndarray:
        return self.pool >= 0

    def fill(self, rows: np.ndarray, other: Locations) -> None:
        """Rows ``rows`` take ``other``'s finds (row i of ``other`` is row ``rows[i]`` here)."""
        for at, pool in enumerate(other.pools):
            sel = np.flatnonzero(other.pool == at)
            if len(sel):
                self.put(rows[sel], pool, other.offset[sel], other.size[sel], other.checksum[sel],
                         other.generation[sel])

    def take(self, rows: np.ndarray) -> Locations:
        """These rows, in this order (the pool list is shared, not copied)."""
        return Locations(self.pools, self.pool[rows], self.offset[rows], self.size[rows], self.checksum[rows],
                         self.generation[rows])

    @classmethod
    def join(cls, parts: Sequence[Locations]) -> Locations:
        """The rows of every part, in order, under one pool list."""
        if not parts:
            return cls.missing(0)
        pools: list[PoolKey] = []
        for part in parts:
            pools.extend(pool for pool in part.pools if pool not in pools)
        remapped = []
        for part in parts:
            index = np.asarray([pools.index(pool) for pool in part.pools] + [-1], dtype=np.int32)
            remapped.append(index[part.pool])  # -1 (a miss) reads the appended -1
        columns = [np.concatenate([getattr(part, name) for part in parts])
                   for name in ("offset", "size", "checksum", "generation")]
        return cls(pools, np.concatenate(remapped), *columns)

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, row: int) -> Location | None:
        index = int(self.pool[row])
        if index < 0:
            return None
        shard_id, incarnation = self.pools[index]
        checksum = int(self.checksum[row])
        return Location(shard_id, incarnation, int(self.offset[row]), int(self.size[row]),
                        None if checksum == NO_CHECKSUM else checksum, int(self.generation[row]))

    def __iter__(self) -> Iterator[Location | None]:
        return (self[row] for row in range(len(self)))


@dataclass
class ReadLease:
    """Locations of the keys asked for, pinned or to be validated after the copy
    (``Locations.generation``); release the lease ids when done."""

    locations: Locations
    lease_ids: dict[PoolKey, list[int]] = field(default_factory=dict)
    calls: int = 0
    """Shard calls the lookup made (answers from a published index on this node cost none)."""
    earlier_reads: np.ndarray | None = None
    """Writer-local placement across nodes: per key, how often this node asked the family root's
    owner for it before (``shard.remote_reads``); None where the owner was not asked."""
    promoted: np.ndarray | None = None
    """Per key, whether its shard read it from its disk tier into the pool to answer this lookup
    (a disk hit; the engine's ``disk_*`` counters); None where no shard did."""

    def merge(self, rows: np.ndarray, other: ReadLease) -> None:
        """Take ``other``'s finds (a lookup of the keys at ``rows`` of this one) and its pins."""
        self.locations.fill(rows, other.locations)
        if other.promoted is not None:
            if self.promoted is None:
                self.promoted = np.zeros(len(self.locations), dtype=bool)
            self.promoted[rows] = other.promoted
        for pool, ids in other.lease_ids.items():
            self.lease_ids.setdefault(pool, []).extend(ids)
        self.calls += other.calls


@dataclass
class SlotGrant:
    """Slots reserved on one pool, not yet bound to keys (a writer binds them at commit)."""

    pool: PoolKey
    token: int
    size: int
    offsets: list[int]


NO_HINT = b""
"""A row's family in ``Publishes.families`` when its commit is told to no family root's owner
(a copy of a hot prefix's block: ``Family.of``; announced to the directory through a steward, ``HintPoster``)."""


@dataclass(frozen=True)
class Publishes:
    """Entries to make visible once their bytes landed, as columns: row i stores ``keys[i]`` in
    the slot ``locations[i]`` of grant ``tokens[i]``. A prompt's save commits a row per block
    (1,024 for a 16k-token prompt) from the engine's thread: as objects, built, grouped per
    grant and pickled row by row, they cost ~5 us a row there (2.5 ms for 512 rows on the
    2-core box); as columns, grouped by numpy, a few us a grant."""

    keys: Sequence[bytes]
    locations: Locations
    tokens: np.ndarray  # int64: the grant of each row's slot
    families: Sequence[bytes] | None = None
    """Per row, the key of its prompt's first block (its family root: where writer-local
    placement tells other nodes about it; ``NO_HINT``: nowhere); None: each row is a family of
    its own."""

    @classmethod
    def of(cls, items: Sequence[tuple[bytes, Location, int]], family: bytes | None = None) -> Publishes:
        """From (key, location, grant token) triples, for callers that commit a few (all of one
        ``family``, if given)."""
        return cls([key for key, _, _ in items], Locations.of([loc for _, loc, _ in items]),
                   np.asarray([token for _, _, token in items], dtype=np.int64),
                   None if family is None else [family] * len(items))

    @classmethod
    def join(cls, parts: Sequence[Publishes]) -> Publishes:
        """One batch of several (their locations' pool lists merged)."""
        if len(parts) == 1:
            return parts[0]
        families = None
        if any(part.families is not None for part in parts):
            families = [family for part in parts for family in part.family_keys()]
        return cls([key for part in parts for key in part.keys], Locations.join([part.locations for part in parts]),
                   np.concatenate([np.zeros(0, dtype=np.int64)] + [part.tokens for part in parts]), families)

    def family_keys(self) -> Sequence[bytes]:
        """Per row, its family root (the row's own key where none was given)."""
        return self.keys if self.families is None else self.families

    def __len__(self) -> int:
        return len(self.keys)

    @cached_property
    def grants(self) -> dict[tuple[PoolKey, int], np.ndarray]:
        """The rows of each (pool, grant token), in row order within each; grouped once (the
        scheduler counts what settled per grant, and the client sends a batch per grant)."""
        if not len(self):
            return {}
        assert (self.locations.pool >= 0).all(), "a publish without a slot"
        order = np.lexsort((self.tokens, self.locations.pool))
        pool, token = self.locations.pool[order], self.tokens[order]
        starts = np.flatnonzero(np.r_[True, (pool[1:] != pool[:-1]) | (token[1:] != token[:-1])])
        ends = np.r_[starts[1:], len(order)]
        return {(self.locations.pools[int(pool[a])], int(token[a])): order[a:b]
                for a, b in zip(starts.tolist(), ends.tolist())}


def rows_picker(rows: np.ndarray) -> Callable[[list[bytes]], list[bytes]]:
    """A function picking these rows (ascending, distinct indices) out of a column of keys: a
    slice where they are one run (a save job's rows of one grant; a chunk of a one-pool
    fleet's save), else ``itemgetter`` (one C call, not a Python loop over the rows)."""
    if not len(rows):
        return lambda column: []
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == len(rows):
        return lambda column: column[first:last + 1]
    if len(rows) == 1:
        return lambda column: [column[first]]
    getter = operator.itemgetter(*rows.tolist())
    return lambda column: list(getter(column))


GrantCommit = tuple[int, list[bytes], np.ndarray, np.ndarray, list[int]]
"""What a shard's ``commit`` takes per grant: its token, the keys to publish, their slots'
offsets and checksums (int64 columns, ``NO_CHECKSUM`` where none) and the offsets to free."""


def grant_items(keys: Sequence[bytes], offsets: np.ndarray,
                checksums: np.ndarray) -> list[tuple[bytes, int, int | None]]:
    """A grant's publishes as ``BlockIndex.commit`` takes them: (key, offset, checksum or None)."""
    return [(key, offset, None if checksum == NO_CHECKSUM else checksum)
            for key, offset, checksum in zip(keys, offsets.tolist(), checksums.tolist())]


@dataclass(frozen=True)
class Removal:
    """Drop ``key`` if it is still the entry at ``location`` (e.g. its checksum failed)."""

    key: bytes
    location: Location


@dataclass(frozen=True)
class Pools:
    """The fleet as one client last saw it: a version and every live pool."""

    version: int
    descriptors: Mapping[PoolKey, PoolDescriptor]
    replication: int = 1
    home: frozenset[PoolKey] | None = None
    """The pools this client's saves land in first (its own node's under writer-local placement);
    None: any pool. Only these keep free slots for saves nobody announced: a baseline on every
    pool of a 1,000-node fleet was a reservation, and its renewals, per engine and pool."""

    def is_home(self, pool: PoolKey) -> bool:
        return self.home is None or pool in self.home


class Pending(ABC, Generic[T]):
    """A posted call (one per shard involved)."""

    @abstractmethod
    def poll(self) -> bool:
        """True once ``result`` will not wait. Never blocks."""

    @abstractmethod
    def result(self) -> T:
        """Wait (at most the store's lookup timeout); a shard that failed contributes a miss."""


class Done(Pending[T]):
    """A result known at once."""

    def __init__(self, value: T) -> None:
        self._value = value

    def poll(self) -> bool:
        return True

    def result(self) -> T:
        return self._value


@dataclass(frozen=True)
class ShardRecord:
    """One live shard as the directory lists it."""

    shard_id: str
    handle: ActorHandle
    pool: PoolDescriptor
    """Carries the shard's incarnation: a restarted shard is a new record."""

    @property
    def key(self) -> PoolKey:
        return self.pool.key


@dataclass(frozen=True)
class Membership:
    """The directory's list of live shards at one version (what its long poll pushes)."""

    version: int
    shards: tuple[ShardRecord, ...]
    replication: int | None = None
    """Copies per block, as the fleet was started with; None: the directory does not say
    (a client then uses its own setting)."""
    placement: str | None = None
    """``placement`` as the fleet was started with (None: as ``replication``)."""
    hot: HotPrefixes = NO_HOT_PREFIXES
    """The fleet's hot-prefix table (``store.hot_prefixes``): pushed with the membership."""
    hot_delta: HotPrefixDelta | None = None
    """Set instead of ``hot`` by a long poll that knew the table revision its caller holds: what
    changed since (``MembershipFeed`` applies it, so a client's membership always has ``hot``)."""
    pool_load: LoadFigures = NO_LOAD
    """The most loaded pools' figures, places in ``shards`` (``store.pool_load``): what a hot
    row's reader picks between."""
    shards_held: bool = False
    """Set by a long poll whose caller holds the shard list of now (only the hot-prefix table moved
    since its version): ``shards`` is then empty, not re-sent (~1.4 KiB a shard with NIXL, to every
    engine on every push), and ``MembershipFeed`` puts back the caller's."""

    def completed(self, known: Membership | None, posted_version: int) -> Membership | None:
        """This long-poll answer made whole from ``known``, what its caller held when it posted
        the poll with ``posted_version``: the shard list put back where it was held, the hot
        delta applied. None when it does not apply to ``known`` (an engine's feed asks again, a
        relay asks for everything)."""
        answer = self
        if answer.shards_held:
            if known is None or known.version != posted_version:
                return None
            answer = replace(answer, shards=known.shards, shards_held=False)
        if answer.hot_delta is not None:
            hot = answer.hot_delta.apply(known.hot) if known is not None else None
            if hot is None:
                return None
            answer = replace(answer, hot=hot, hot_delta=None)
        return answer

    @property
    def shard_ids(self) -> list[str]:
        return [s.shard_id for s in self.shards]

    @property
    def descriptors(self) -> dict[PoolKey, PoolDescriptor]:
        return {s.key: s.pool for s in self.shards}
