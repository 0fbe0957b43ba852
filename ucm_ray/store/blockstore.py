"""BlockStore: the control calls of the tier, as the connector's scheduler side uses them.

One owner of the block lifecycle: the engine's scheduler process holds a
``BlockStore`` and does every control call (pin, reserve, commit, release,
remove); workers only move bytes through ``transport.pools.PoolConnections``
and report per-job results back. Two implementations: the Ray client
(``store.client.StoreClient``: shards are actors) and an in-process one
(``store.local.LocalBlockStore``: a fast test double of the same rules, used by
the two-halves harness).

Every call is batched (one call per shard whatever the number of keys) and
returns a ``Pending`` that never blocks on ``poll``. A shard that fails, times
out, or answers for another incarnation is a miss for that call, never an
error the engine sees.

Fencing: every shard start gets a random 63-bit *incarnation*. Locations,
lease ids and slot grants carry the (shard id, incarnation) they belong to; a
shard refuses ids of another incarnation, and a client closes the mapping of
an old incarnation before it maps the new one. Lease ids and grant tokens are
random 63-bit values checked against the ``owner`` that asked for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from ucm_ray.transport.base import PoolDescriptor, PoolKey

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
    """CRC32 taken by the writer at commit, a property of the entry: every reader verifies it."""
    generation: int = 0
    """Nonzero: found in the shard's published index, unpinned; a copy from it counts only if
    the same generation is still listed afterwards (``store.published``). 0: pinned by a lease."""

    @property
    def pool(self) -> PoolKey:
        return (self.shard_id, self.incarnation)


@dataclass
class ReadLease:
    """Locations of the keys asked for (None: a miss), pinned or to be validated after the copy
    (``Location.generation``); release the lease ids when done."""

    locations: list[Location | None]
    lease_ids: dict[PoolKey, list[int]] = field(default_factory=dict)


@dataclass
class SlotGrant:
    """Slots reserved on one pool, not yet bound to keys (a writer binds them at commit)."""

    pool: PoolKey
    token: int
    size: int
    offsets: list[int]


@dataclass(frozen=True)
class Publish:
    """Make ``key`` visible at ``location`` (a slot of grant ``token``) once its bytes landed."""

    key: bytes
    location: Location
    token: int


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


class BlockStore(ABC):
    """Control calls of the tier. Not thread-safe: one scheduler thread drives it."""

    owner: int
    """Random 63-bit id of this client; leases and grants are checked against it."""

    @abstractmethod
    def pools(self) -> Pools:
        """Current membership (picks up changes without blocking)."""

    @abstractmethod
    def owners(self, keys: Sequence[bytes]) -> list[list[PoolKey]]:
        """Per key, the pools that should hold it (``replication`` of them, fewer if fewer live)."""

    @abstractmethod
    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = ()) -> Pending[ReadLease]:
        """Locate what is committed among ``keys`` on a live replica: read from the published
        index of a pool on this node (no call, no pin: the reader validates its copy), pinned
        through a call elsewhere and on the pools in ``pin`` (where a reader cannot validate)."""

    @abstractmethod
    def release(self, lease_ids: Mapping[PoolKey, Sequence[int]]) -> Pending[set[PoolKey]]:
        """Unpin; the result names pools where a lease was not (or no longer) held."""

    @abstractmethod
    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        """Up to ``count`` fresh slots of ``size`` bytes, invisible until published."""

    @abstractmethod
    def renew(self, grants: Mapping[PoolKey, Sequence[int]]) -> Pending[set[tuple[PoolKey, int]]]:
        """Extend reservations still held; the result names (pool, token) that had expired."""

    @abstractmethod
    def commit(self, publish: Sequence[Publish],
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        """Publish entries whose bytes landed, return unused or failed slots (``free``, per
        (pool, token)); per publish, whether the key is now visible from this write."""

    @abstractmethod
    def remove(self, removals: Sequence[Removal]) -> Pending[int]:
        """Drop entries found corrupt; a pinned one stops being visible at once and its slot
        is freed when the last pin goes."""

    @abstractmethod
    def suspect(self, pool: PoolKey) -> None:
        """A worker's copies with ``pool`` failed: back off from it until a probe answers."""

    @abstractmethod
    def close(self) -> None: ...
