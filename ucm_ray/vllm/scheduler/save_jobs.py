"""Save jobs: planned blocks bound to granted write slots, sent to the workers as one job per
rank, and remembered until a worker reports them (or never will)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import NO_CHECKSUM, Locations, rows_picker
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.metadata import BlockSaves
from ucm_ray.vllm.scheduler.geometry import NULL_BLOCK_ID
from ucm_ray.vllm.scheduler.request import TrackedRequests

Placed = tuple[list[PoolKey], np.ndarray]
"""Keys' owners as ``BlockStore.placement`` gives them: the pools, and per key a row of indices
into them, best first."""


def one_pool_list(placed: list[Placed], keys: Callable[[], Sequence[bytes]], store: BlockStore) -> Placed:
    """Several placements' rows (of ``keys()``, in order) as one. They were placed under one
    membership unless their pool lists or widths differ: the fleet changed between two of them
    (on Ray, ``pools()`` adopts a pushed membership at any call, and a request's blocks are
    placed once per membership). Then every key is placed again, under the current membership:
    rows of two memberships may not be as wide (replication over fewer shards than it asks for:
    joined, they raised in vLLM's step), and the older rows may name a pool that is gone."""
    if not placed:
        return [], np.zeros((0, 0), dtype=np.int64)
    pools, first = placed[0]
    if len(placed) == 1:
        return pools, first
    if any(theirs != pools or owners.shape[1] != first.shape[1] for theirs, owners in placed[1:]):
        return store.placement(keys())
    return pools, np.concatenate([owners for _, owners in placed])


@dataclass
class WantedSaves:
    """A step's blocks (or states) to save, one request's run of a (group, rank) at a time, as
    columns: per row its tp rank, kv-cache group, index among the request's blocks, vLLM block
    id, key, family root (the key of its prompt's first block on that rank, where writer-local
    placement tells other nodes about it) and owners (placed once per request: its prompt's
    announcement placed the same keys). A 4k prompt's 256 blocks were 256 tuples, unpacked
    again and placed again to bind them: ~0.5 ms of the scheduler's step per prompt here."""

    ranks: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    """Per run, its rank and group."""
    blocks: list[np.ndarray] = field(default_factory=list)
    block_ids: list[np.ndarray] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    families: list[bytes] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)

    def add(self, rank: int, group: int, blocks: np.ndarray, block_ids: np.ndarray, keys: list[bytes],
            families: list[bytes], placed: Placed) -> None:
        """One run of rows: ``blocks`` (indices) of one group on one rank, and their keys' owners."""
        if len(keys):
            self.ranks.append(rank)
            self.groups.append(group)
            self.blocks.append(blocks)
            self.block_ids.append(block_ids)
            self.keys += keys
            self.families += families
            self.placed.append(placed)

    @classmethod
    def joined(cls, parts: list[WantedSaves]) -> WantedSaves:
        """Several requests' wanted saves as one, rows in the order of ``parts``."""
        if len(parts) == 1:
            return parts[0]
        return cls(**{column.name: [row for part in parts for row in getattr(part, column.name)]
                      for column in fields(cls)})

    def __len__(self) -> int:
        return len(self.keys)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per row: rank, group, block index, vLLM block id."""
        lengths = [len(run) for run in self.blocks]
        return (np.repeat(np.asarray(self.ranks, dtype=np.int64), lengths),
                np.repeat(np.asarray(self.groups, dtype=np.int64), lengths),
                np.concatenate(self.blocks).astype(np.int64, copy=False),
                np.concatenate(self.block_ids).astype(np.int64, copy=False))


@dataclass
class SaveRows:
    """One rank's saves of one step, gathered a slot class at a time (``extend``: columns, not a
    call per block: a 4k prompt's 256 blocks were 256 calls of 8 appends on the scheduler's
    critical path); sent as ``BlockSaves`` columns."""

    groups: list[np.ndarray] = field(default_factory=list)
    block_ids: list[np.ndarray] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    families: list[bytes] = field(default_factory=list)
    pools: list[PoolKey] = field(default_factory=list)
    """Per chunk, its pool."""
    offsets: list[np.ndarray] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    """Per chunk, its entries' size."""
    counts: list[int] = field(default_factory=list)
    """Per chunk, its rows."""
    tokens: list[np.ndarray] = field(default_factory=list)  # per chunk, the grant of each row's slot

    def extend(self, groups: np.ndarray, block_ids: np.ndarray, keys: list[bytes], families: list[bytes],
               pool: PoolKey, size: int, tokens: np.ndarray, offsets: np.ndarray) -> None:
        """Rows of one slot class (``pool``, ``size``), each bound to its slot (its grant's
        token, its offset)."""
        self.groups.append(groups)
        self.block_ids.append(block_ids)
        self.keys += keys
        self.families += families
        self.pools.append(pool)
        self.sizes.append(size)
        self.counts.append(len(offsets))
        self.tokens.append(tokens)
        self.offsets.append(offsets)


SaveRowsByRank = defaultdict[int, SaveRows]
"""A step's save rows per tp rank (a rank without rows has no entry)."""


def save_rows() -> SaveRowsByRank:
    """A step's save rows, empty (made for a rank once it has a row)."""
    return defaultdict(SaveRows)


@dataclass
class SaveInFlight:
    """A dispatched save job: per row, the key it stores and the grant of its slot; the vLLM
    blocks it copies (a step that allocates one of them again waits for it: ``fences``) and the
    requests they belong to."""

    keys: list[bytes]
    families: list[bytes]
    locations: Locations
    tokens: np.ndarray
    block_ids: np.ndarray
    requests: list[str]
    dispatched: float


class SaveJobs:
    """Binds a step's planned blocks to slots, dispatches them as jobs, and keeps the jobs
    whose results are not in yet (``in_flight``, by job id)."""

    def __init__(self, store: BlockStore, slots: SlotSupply, entry_bytes: list[int], requests: TrackedRequests,
                 job_ids: Iterator[int], clock: Callable[[], float]) -> None:
        self._store = store
        self._slots = slots
        self._sizes = np.asarray(sorted(set(entry_bytes)), dtype=np.int64)
        """The model's distinct entry sizes (one or two): a slot class is (pool, one of these)."""
        self._size_of_group = np.asarray(np.searchsorted(self._sizes, entry_bytes), dtype=np.int64)
        """Per kv-cache group, its entry size's index in ``_sizes``."""
        self._requests = requests
        self._job_ids = job_ids
        self._clock = clock
        self.in_flight: dict[int, SaveInFlight] = {}

    def bind(self, saves: SaveRowsByRank, wanted: WantedSaves) -> np.ndarray:
        """Bind granted slots on the owners of each row's key to it, as
        rows of its rank's saves. Per row, whether any replica got a slot (vLLM's placeholder
        block counts as saved: it holds no data of the request); those without wait."""
        if not len(wanted):
            return np.zeros(0, dtype=bool)
        ranks, groups, _, block_ids = wanted.columns()
        keys, families = wanted.keys, wanted.families
        bound = block_ids == NULL_BLOCK_ID
        real = np.flatnonzero(~bound)
        if not len(real):
            return bound
        pools, owners = one_pool_list(wanted.placed, lambda: keys, self._store)
        if len(real) < len(keys):
            owners = owners[real]
        sizes = self._sizes
        size_at = self._size_of_group[groups[real]]
        for replica in range(owners.shape[1]):
            # rows per slot class (pool, size), classes in that order, rows in row order
            slot_class = owners[:, replica].astype(np.int64) * len(sizes) + size_at
            order = np.argsort(slot_class, kind="stable")
            ordered = slot_class[order]
            bounds = np.flatnonzero(np.diff(ordered)) + 1
            for chunk in np.split(order, bounds) if len(bounds) else (order,):
                pool_at, size = divmod(int(slot_class[chunk[0]]), len(sizes))
                slots = self._slots.take(pools[pool_at], int(sizes[size]), len(chunk))
                if not slots:
                    continue
                taken = real[chunk[:len(slots)]]
                bound[taken] = True
                taken_ranks = ranks[taken]
                for rank in dict.fromkeys(taken_ranks.tolist()):  # one rank, but under tensor parallelism
                    mine = np.flatnonzero(taken_ranks == rank)
                    every = len(mine) == len(taken)
                    rows_of = taken if every else taken[mine]
                    pick = rows_picker(rows_of)
                    saves[rank].extend(groups[rows_of], block_ids[rows_of], pick(keys), pick(families),
                                       pools[pool_at], int(sizes[size]),
                                       slots.tokens if every else slots.tokens[mine],
                                       slots.offsets if every else slots.offsets[mine])
        return bound

    def dispatch(self, saves: SaveRowsByRank, requests: list[str]) -> dict[int, BlockSaves]:
        """Per rank, its rows as one save job (remembered until the worker reports it), each
        job held by ``requests`` (whose blocks it copies) until it is."""
        out: dict[int, BlockSaves] = {}
        for rank, rows in saves.items():
            pools = list(dict.fromkeys(rows.pools))
            at = {pool: index for index, pool in enumerate(pools)}
            n = len(rows.keys)
            counts = np.asarray(rows.counts, dtype=np.int64)
            pool_of: np.ndarray = np.repeat(np.asarray([at[pool] for pool in rows.pools], dtype=np.int32), counts)
            locations = Locations(pools, pool_of,
                                  np.concatenate(rows.offsets),
                                  np.repeat(np.asarray(rows.sizes, dtype=np.int64), counts),
                                  np.full(n, NO_CHECKSUM, dtype=np.int64), np.zeros(n, dtype=np.uint64))
            job = BlockSaves(next(self._job_ids), np.concatenate(rows.groups).astype(np.int64),
                             np.concatenate(rows.block_ids).astype(np.int64), locations)
            self.in_flight[job.job_id] = SaveInFlight(rows.keys, rows.families, locations,
                                                      np.concatenate(rows.tokens), job.block_ids,
                                                      requests, self._clock())
            for req_id in requests:
                self._requests.by_id[req_id].save_jobs.add(job.job_id)
            out[rank] = job
        return out

    def forget(self, job_id: int) -> SaveInFlight | None:
        """A save job whose result is in (or never will be): its requests no longer wait for it."""
        job = self.in_flight.pop(job_id, None)
        for req_id in job.requests if job is not None else []:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.save_jobs.discard(job_id)
        return job

    def abandon_overdue(self, dispatched_before: float) -> None:
        """Jobs whose worker never reported: a copy may still land, so their slots are
        quarantined, never reused."""
        for job_id in [j for j, job in self.in_flight.items() if job.dispatched < dispatched_before]:
            job = self.forget(job_id)
            assert job is not None
            for pool, token in zip(job.locations.pool.tolist(), job.tokens.tolist()):
                self._slots.abandon(job.locations.pools[pool], token)

    def fenced(self, reused_block_ids: list[int]) -> set[int]:
        """Jobs still copying any of these blocks."""
        if not self.in_flight or not reused_block_ids:
            return set()
        reused = np.asarray(reused_block_ids, dtype=np.int64)
        return {job_id for job_id, job in self.in_flight.items() if np.isin(job.block_ids, reused).any()}
