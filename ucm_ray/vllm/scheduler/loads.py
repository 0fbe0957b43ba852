"""Load planning: a hit vLLM took becomes one load job per tp rank, handed to the workers by
the next step's plan, whole or layer by layer; and the fences a step's loads and new blocks
need (save jobs still copying blocks it writes)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.types import ReadLease
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.metadata import BlockLoads, LoadJob, UcmRayConnectorMetadata
from ucm_ray.vllm.scheduler.geometry import NULL_BLOCK_ID, CacheGeometry
from ucm_ray.vllm.scheduler.request import Lookup, Phase, TrackedRequest, TrackedRequests
from ucm_ray.vllm.scheduler.save_jobs import SaveJobs

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__package__)


@dataclass
class LoadInFlight:
    """Pins a dispatched load holds until the worker reports its copies over."""

    req_id: str
    rank: int
    lease_ids: dict[PoolKey, list[int]]
    blocks: BlockLoads
    """What was loaded: the keys of entries the worker finds corrupt, to remove them."""
    dispatched: float
    start: int
    """The hit's first token this load brings: its attention blocks' positions in the request
    follow from it (an asynchronous load's request has no block ids of its own while it waits)."""
    earlier_reads: np.ndarray | None = None
    """Per block of ``blocks``, this node's reads of it before (``ReadLease.earlier_reads``):
    whether to keep a copy of it once it came from another node; None: not counted."""
    from_disk: int = 0
    """Of ``blocks``, those its shard read from its disk tier to answer the lookup (disk hits)."""

    def positions(self, attn: Sequence[int], block_sizes: Sequence[int]) -> dict[int, dict[int, int]]:
        """Per attention group, each loaded vLLM block id's index among the request's blocks
        (a group's rows are its blocks from the hit's start on, in order)."""
        groups, block_ids = self.blocks.groups, self.blocks.block_ids
        out = {}
        for g in attn:
            ids = block_ids[groups == g].tolist()
            first = self.start // block_sizes[g]
            out[g] = {block_id: first + k for k, block_id in enumerate(ids)}
        return out


@dataclass
class _RankRows:
    """One rank's rows of a load: which of its lookup's keys, into which vLLM blocks."""

    rows: list[range]  # of the rank's keys (and lease): attention groups', then states'
    groups: list[int]
    targets: list[int]
    tails: list[bool]


class LoadPlanner:
    """Plans each hit's load jobs at allocation and hands them to the workers at the next plan;
    keeps the pins of dispatched loads (``in_flight``, by job id) until they are reported."""

    def __init__(self, geometry: CacheGeometry, config: UcmRayConfig, requests: TrackedRequests,
                 save_jobs: SaveJobs, job_ids: Iterator[int], clock: Callable[[], float]) -> None:
        self._geometry = geometry
        self._config = config
        self._requests = requests
        self._save_jobs = save_jobs
        self._job_ids = job_ids
        self._clock = clock
        self.in_flight: dict[int, LoadInFlight] = {}
        self.to_dispatch: dict[str, tuple[TrackedRequest, list[LoadJob]]] = {}
        """Requests given load jobs since the last plan (most steps none)."""

    def plan(self, tracked: TrackedRequest, lookup: Lookup, block_ids: tuple[list[int], ...], start: int,
             end: int) -> list[LoadJob]:
        """Per rank, the job loading the hit's tokens ``[start, end)`` into vLLM's ``block_ids``
        (per group) from what the lookup pinned; sent with the next plan."""
        assert lookup.leases is not None
        request_id = tracked.request.request_id
        loads = []
        for rank, lease in enumerate(lookup.leases):
            blocks, taken, usable = self._blocks(tracked, lookup, lease, rank, block_ids, start, end)
            job = LoadJob(next(self._job_ids), request_id, blocks, complete_in_start=self._geometry.async_loads,
                          is_async=self._geometry.async_loads, failed=not usable)
            earlier = None if lease.earlier_reads is None or not usable else lease.earlier_reads.take(taken)
            from_disk = 0 if lease.promoted is None or not usable else int(lease.promoted[taken].sum())
            self.in_flight[job.job_id] = LoadInFlight(request_id, rank, lease.lease_ids, blocks, self._clock(), start,
                                                      earlier, from_disk)
            loads.append(job)
        self.to_dispatch[request_id] = (tracked, loads)
        return loads

    def _blocks(self, tracked: TrackedRequest, lookup: Lookup, lease: ReadLease, rank: int,
                block_ids: tuple[list[int], ...], start: int, end: int) -> tuple[BlockLoads, np.ndarray, bool]:
        """One rank's blocks to load, the lease's rows they are, and whether the load is usable
        (vLLM's null block is no target of it)."""
        rank_rows = self._rows(tracked, lookup, rank, block_ids, start, end)
        taken = np.fromiter(itertools.chain.from_iterable(rank_rows.rows), dtype=np.int64)
        keys = lookup.flat_keys(rank)
        blocks = BlockLoads(np.asarray(rank_rows.groups, dtype=np.int64),
                            np.asarray(rank_rows.targets, dtype=np.int64),
                            lease.locations.take(taken), [keys[i] for i in taken.tolist()],
                            np.asarray(rank_rows.tails, dtype=bool))
        assert blocks.locations.found().all() and len(rank_rows.targets) == len(taken)
        if NULL_BLOCK_ID in rank_rows.targets:
            log.error("ucm-ray: vLLM's null block is a target of %s's load at %d tokens; the load is "
                      "failed so vLLM recomputes", tracked.request.request_id, tracked.hit_tokens)
            return BlockLoads.of([]), taken, False
        return blocks, taken, True

    def _rows(self, tracked: TrackedRequest, lookup: Lookup, rank: int, block_ids: tuple[list[int], ...],
              start: int, end: int) -> _RankRows:
        geometry = self._geometry
        out = _RankRows([], [], [], [])
        at = 0
        for g, group_keys in zip(geometry.attn, lookup.attn_keys[rank]):
            size = geometry.block_sizes[g]
            first, last = start // size, -(-end // size)  # the tail block is loaded whole
            out.rows.append(range(at + first, at + last))
            out.groups.extend([g] * (last - first))
            out.targets.extend(block_ids[g][first:last])
            out.tails.extend([False] * (last - first))
            if end % size and last > first:
                out.tails[-1] = True  # the forward writes this block's recomputed tokens
            at += len(group_keys)
        if geometry.hybrid:
            boundary = tracked.hit_tokens // geometry.lcm  # the state at the hit's end boundary
            for g, group_keys in zip(geometry.states, lookup.state_keys[rank]):
                out.rows.append(range(at + boundary - 1, at + boundary))
                out.groups.append(g)
                # vLLM keeps the running state of a request that computed N tokens in the
                # group's block N // block_size - 1; a null block there means no room for it.
                out.targets.append(block_ids[g][tracked.hit_tokens // geometry.block_sizes[g] - 1])
                out.tails.append(False)  # loaded before the forward anyway: no hook waits for states
                at += len(group_keys)
        return out

    def dispatch(self, out: SchedulerOutput, meta: UcmRayConnectorMetadata) -> None:
        """The load jobs planned since the last plan, into ``meta``: whole (before the forward)
        where the step computes little beside its hits (``policy.loads_at_once``) or runs no
        layer hook, else layer by layer."""
        if not self.to_dispatch:
            return  # most steps: no call below
        loading = self._loading_now()
        if not loading:
            return
        at_once = policy.loads_at_once(out.total_num_scheduled_tokens,
                                       sum(tracked.external_tokens for tracked, _ in loading),
                                       self._config.load_at_once_ratio)
        for tracked, jobs in loading:
            # fewer tokens than the FULL-graph threshold: no layer hook may run in this step
            whole = at_once or out.num_scheduled_tokens.get(tracked.request.request_id, 0) < self._geometry.recompute
            for rank, job in enumerate(jobs):
                job.complete_in_start = job.complete_in_start or whole
                meta.loads.setdefault(rank, []).append(job)
            tracked.loads_dispatched()

    def _loading_now(self) -> list[tuple[TrackedRequest, list[LoadJob]]]:
        """The requests still loading that were given load jobs since the last plan (most steps
        none: with many requests decoding, looking at each for jobs cost every step's plan)."""
        loading, self.to_dispatch = self.to_dispatch, {}
        return [(tracked, jobs) for req_id, (tracked, jobs) in loading.items()
                if self._requests.get(req_id) is tracked and tracked.phase is Phase.LOADING]

    def fences(self, out: SchedulerOutput, loads: dict[int, list[LoadJob]]) -> set[int]:
        """Save jobs still copying blocks that this step writes: blocks allocated again (a
        preempted request's), and the targets of its loads (an asynchronous load's request is
        not scheduled this step). A new request's computed prefix (vLLM's own hit, only read;
        an external hit's blocks are load targets) needs no wait."""
        if not self._save_jobs.in_flight:
            return set()
        allocated: list[int] = [block_id for jobs in loads.values() for job in jobs
                                for block_id in job.blocks.block_ids.tolist()]
        for new in out.scheduled_new_reqs:
            for g, ids in enumerate(new.block_ids):
                read_only = new.num_computed_tokens // self._geometry.block_sizes[g] if g in self._geometry.attn else 0
                allocated.extend(ids[read_only:])
        for new_ids in out.scheduled_cached_reqs.new_block_ids:
            if new_ids is not None:
                for ids in new_ids:
                    allocated.extend(ids)
        return self._save_jobs.fenced(allocated)

    def finished(self, job_id: int) -> LoadInFlight | None:
        """A load the worker reported: its pins are the caller's to release."""
        return self.in_flight.pop(job_id, None)

    def take_overdue(self, dispatched_before: float) -> list[LoadInFlight]:
        """Loads whose worker never reported: their pins are the caller's to release."""
        return [self.in_flight.pop(job_id) for job_id in
                [j for j, load in self.in_flight.items() if load.dispatched < dispatched_before]]
