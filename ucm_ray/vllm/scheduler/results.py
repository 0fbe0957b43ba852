"""What the workers reported, acted on: the entries that landed are committed, the slots that
did not are freed (or quarantined where a late copy may still land), loads' pins are released,
entries that failed their checksum are removed, and blocks whose load failed are saved again
once recomputed. Jobs a worker never reported are given up after half a reservation."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import Publishes, Removal
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.metadata import UcmRayWorkerMetadata
from ucm_ray.vllm.scheduler.answers import Pins, StoreAnswers
from ucm_ray.vllm.scheduler.geometry import CacheGeometry
from ucm_ray.vllm.scheduler.loads import LoadInFlight, LoadPlanner
from ucm_ray.vllm.scheduler.lookup import Lookups
from ucm_ray.vllm.scheduler.request import TrackedRequests
from ucm_ray.vllm.scheduler.saves import SavePlanner
from ucm_ray.vllm.stats import UcmRayStats

log = logging.getLogger(__package__)

Grant = tuple[PoolKey, int]
"""(pool, grant token) of a slot."""


class Results:
    """Takes the workers' per-job results and collects the store's answers (never waits)."""

    def __init__(self, geometry: CacheGeometry, config: UcmRayConfig, store: BlockStore, requests: TrackedRequests,
                 lookups: Lookups, loads: LoadPlanner, saves: SavePlanner, answers: StoreAnswers, slots: SlotSupply,
                 stats: UcmRayStats, clock: Callable[[], float]) -> None:
        self._geometry = geometry
        self._config = config
        self._store = store
        self._requests = requests
        self._lookups = lookups
        self._loads = loads
        self._saves = saves
        self._answers = answers
        self._slots = slots
        self._stats = stats
        self._clock = clock

    def take(self, results: UcmRayWorkerMetadata) -> None:
        """One step's results from the workers."""
        for pool in results.failed_pools:
            self._store.suspect(pool)
            self._slots.abandon_pool(pool)
        self._lookups.pin_entries_of(results.unvalidated_pools)
        self._commit_saves(results)
        self._finish_loads(results)

    def _commit_saves(self, results: UcmRayWorkerMetadata) -> None:
        """Commit the rows that landed; free the slots of those that did not."""
        landed: list[Publishes] = []
        free: dict[Grant, list[int]] = defaultdict(list)
        settled: dict[Grant, int] = defaultdict(int)
        for job_id, result in results.saves.items():
            job = self._saves.jobs.forget(job_id)
            if job is None:
                continue
            locations, rows = job.locations, np.flatnonzero(result.landed)
            stored = locations.take(rows)
            if result.checksums is not None:
                stored.checksum = result.checksums[rows].astype(np.int64)
            every = len(rows) == len(job.keys)  # most jobs: no row picked out one by one
            landed.append(Publishes(job.keys if every else [job.keys[row] for row in rows.tolist()], stored,
                                    job.tokens[rows],
                                    job.families if every else [job.families[row] for row in rows.tolist()]))
            for row in np.flatnonzero(~result.landed).tolist():
                pool, token = locations.pools[locations.pool[row]], int(job.tokens[row])
                if result.uncertain:
                    self._slots.abandon(pool, token)  # a late copy may land: quarantine, never reuse
                else:
                    free[(pool, token)].append(int(locations.offset[row]))
                    settled[(pool, token)] += 1
        publish = Publishes.join(landed)
        if len(publish) or free:
            self._answers.commit(publish, dict(free))
            self._stats.add(saved_blocks=len(publish))
            for grant, rows in publish.grants.items():
                settled[grant] += len(rows)
            for (pool, token), count in settled.items():
                self._slots.settled(pool, token, count)

    def _finish_loads(self, results: UcmRayWorkerMetadata) -> None:
        """Release the pins of the loads reported over; remove entries that failed their
        checksum; blocks that failed to load are saved again once recomputed."""
        pins: Pins = []
        removals: list[Removal] = []
        for job_id in results.loads_done:
            load = self._loads.finished(job_id)
            if load is None:
                continue
            pins.extend(load.lease_ids.items())
            if results.corrupt:
                corrupt = set(results.corrupt)
                removals.extend(Removal(key, loc) for key, loc in zip(load.blocks.keys, load.blocks.locations)
                                if loc in corrupt)
            failed = results.load_failures.get(job_id, [])
            self._store.loaded(load.blocks.locations)
            self._save_again(load, failed)
            if not failed:
                self._keep_copies(load)
            elif self._geometry.async_loads and (tracked := self._requests.get(load.req_id)) is not None:
                tracked.async_load_failed = True
        self._answers.release(pins)
        if removals:
            log.error("ucm-ray: removing %d stored entries that failed their checksum", len(removals))
            self._answers.remove(removals)

    def _save_again(self, load: LoadInFlight, failed_block_ids: list[int]) -> None:
        """Blocks that failed to load (the store evidently lost them) are saved again once vLLM
        recomputed them; only those, not the rest of the prefix."""
        tracked = self._requests.get(load.req_id)
        if tracked is None or not failed_block_ids:
            return
        positions = load.positions(self._geometry.attn, self._geometry.block_sizes)
        for g in self._geometry.attn:
            failed = [positions[g][b] for b in failed_block_ids if b in positions[g]]
            for i in failed:
                tracked.save_again(g, load.rank, i)
            size = self._geometry.block_sizes[g]
            for i in failed:
                self._saves.expect(tracked, (i + 1) * size, i * size)

    def _keep_copies(self, load: LoadInFlight) -> None:
        """A load that landed whole: the blocks it brought from other nodes that this node read
        ``remote_copy_reads`` times (the family root's owner counted) are saved into this node's
        pool too. Not from a load with a failure (a failed block's neighbours are recomputed), nor
        a hybrid's (its blocks hit only beside a state at their boundary), nor the block a hit
        ends inside (the forward writes its tail); a block is saved only once the request's
        computed tokens pass it (``SavePlanner._wanted``), so never while a recompute rewrites it."""
        copy_at = self._config.remote_copy_reads
        tracked = self._requests.get(load.req_id)
        blocks = load.blocks
        if not copy_at or tracked is None or self._geometry.hybrid or not len(blocks):
            return
        rows = self._store.remote_rows(blocks.locations)
        if load.earlier_reads is not None:
            rows = [row for row in rows if load.earlier_reads[row] + 1 >= copy_at]
        elif copy_at > 1:
            return  # not counted: a first read
        if not rows:
            return
        wanted: dict[int, list[int]] = defaultdict(list)
        positions = load.positions(self._geometry.attn, self._geometry.block_sizes)
        groups, block_ids, tails = blocks.groups.tolist(), blocks.block_ids.tolist(), blocks.before_forward.tolist()
        for row in rows:
            at = positions.get(groups[row], {}).get(block_ids[row])
            if not tails[row] and at is not None:
                wanted[groups[row]].append(at)
        if wanted:
            self._saves.keep_copies(tracked, load.rank, dict(wanted))

    def collect(self) -> None:
        """Check what the shards said to our commits, releases and removals (never waits), and
        give up on jobs whose worker never reported."""
        saves, loads = self._saves.jobs.in_flight, self._loads.in_flight
        if self._answers.idle and not saves and not loads:
            return  # most decode steps
        self._answers.collect()
        overdue = self._clock() - self._config.reserve_timeout_s / 2
        self._saves.jobs.abandon_overdue(overdue)  # a copy may still land: its slots are quarantined
        for load in self._loads.take_overdue(overdue):
            self._answers.release(list(load.lease_ids.items()))
