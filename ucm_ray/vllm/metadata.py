"""What the two halves of the connector tell each other each step (pickled by vLLM).

Scheduler -> worker (``UcmRayConnectorMetadata``): byte-moving jobs with every
location already decided (pins taken, slots granted), plus the pool
descriptors whenever membership changed. Worker -> scheduler
(``UcmRayWorkerMetadata``, through vLLM's ``kv_connector_worker_meta``): per-job
results, from which the scheduler commits, frees and releases. The worker
never makes a control call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm_ray.store.types import Location, Locations
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.vllm.compat import KVConnectorWorkerMetadata


@dataclass(eq=False)
class BlockLoads:
    """A load job's blocks as columns: row i copies the stored entry at ``locations[i]`` into
    vLLM block ``block_ids[i]`` of kv-cache group ``groups[i]``; ``keys[i]`` validates it after
    the copy where it was read unpinned (``locations.generation``). Columns, not an object per
    block: a 16k-token hit loads ~1,000 blocks per rank, and this crosses to the worker (pickled
    where it runs in another process) and is walked there several times per step."""

    groups: np.ndarray  # int64
    block_ids: np.ndarray  # int64
    locations: Locations
    keys: list[bytes]
    before_forward: np.ndarray  # bool
    """Load this block whole before the forward pass begins, not layer by layer: the hit ends
    inside it, and vLLM writes the K/V of the tokens it recomputes there (the block's tail) before
    a layer's hook waits for that layer's load. A load landing after that write would overwrite
    this engine's values with another engine's (bitwise they may differ), and a checksum taken
    after it would fail a good entry."""

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, Location, bytes]]) -> BlockLoads:
        """From (group, block id, location, key) rows, none of them needed before the forward."""
        return cls(np.asarray([row[0] for row in rows], dtype=np.int64),
                   np.asarray([row[1] for row in rows], dtype=np.int64),
                   Locations.of([row[2] for row in rows]), [row[3] for row in rows],
                   np.zeros(len(rows), dtype=bool))

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class LoadJob:
    """One request's loads for one tp rank."""

    job_id: int
    req_id: str
    blocks: BlockLoads
    complete_in_start: bool = False
    """Load everything in ``start_load_kv`` (``policy.loads_at_once``): this step runs fewer
    tokens than the FULL-CUDA-graph threshold (2 + k), so it may replay a graph in which no
    layer hook runs, or the step computes too little beside what it loads for layer hooks to
    hide the copies behind."""
    failed: bool = False
    """The plan could not place every entry: report the whole load as failed (vLLM recomputes)."""
    is_async: bool = False
    """Reported through ``finished_recving`` / ``failed_recving`` (hybrid caches: vLLM cannot
    take back a failed synchronous load of a multi-group cache)."""


@dataclass(eq=False)
class BlockSaves:
    """One rank's saves of one step as columns: row i copies vLLM block ``block_ids[i]`` of
    kv-cache group ``groups[i]`` into the granted slot ``locations[i]``; a block saved on r
    replicas has r rows. Columns, as ``BlockLoads``: a 16k-token prompt saves ~1,000 blocks per
    rank, and an object per block cost the cold request host time at every pass."""

    job_id: int
    groups: np.ndarray  # int64
    block_ids: np.ndarray  # int64
    locations: Locations

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class UcmRayConnectorMetadata(KVConnectorMetadata):
    loads: dict[int, list[LoadJob]] = field(default_factory=dict)
    """tp rank -> loads for that rank."""
    saves: dict[int, BlockSaves] = field(default_factory=dict)
    """tp rank -> attention blocks that earlier steps filled: copied from the start of this step,
    beside its forward pass, so no save is on the path of the step that computes the blocks (a
    cold request's first token)."""
    state_saves: dict[int, BlockSaves] = field(default_factory=dict)
    """tp rank -> mamba states this step computes: copied once its forward is over (the next
    step overwrites them, so they cannot wait)."""
    saved_requests: set[str] = field(default_factory=set)
    """Finished requests whose blocks vLLM kept for their saves, all of which the scheduler knows
    landed: reported ``finished_sending`` at once (vLLM frees the blocks)."""
    fences: set[int] = field(default_factory=set)
    """Save jobs (earlier steps') still copying blocks that this step writes (allocated again,
    or load targets): vLLM's zeroing, its loads and its forward must come after their copies."""
    pools: Mapping[PoolKey, PoolDescriptor] | None = None
    """Every live pool, sent when membership changed since the last step (None: unchanged).
    A worker closes the mapping of any pool not listed (a dead shard, an old incarnation)."""
    work: bool = True
    """False only in ``QUIET_STEP``, the metadata of every step with nothing for the workers:
    a worker with no job of its own left then does nothing in the step's hooks."""

    def carries_work(self) -> bool:
        """Whether the workers have anything to do for this step beyond looking at their copies
        (``loads`` holds a rank only once a job is added for it)."""
        return bool(self.loads or self.saves or self.state_saves or self.saved_requests
                    or self.fences or self.pools is not None)


QUIET_STEP = UcmRayConnectorMetadata(work=False)
"""The scheduler's metadata for every step that gives the workers nothing to do (most decode
steps), one object: such a step makes none, and a worker sees ``work`` False (read only)."""


@dataclass(eq=False)
class SaveResult:
    landed: np.ndarray
    """Per row of the job (bool), whether every byte of the entry landed in that slot."""
    checksums: np.ndarray | None = None
    """Per row (int64), the checksum of the entry, when the writer runs in paranoid mode."""
    uncertain: bool = False
    """A copy timed out and may still land: the slots must never be reused."""


@dataclass
class UcmRayWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-job results of one step, merged across tp ranks (job ids are unique per engine)."""

    saves: dict[int, SaveResult] = field(default_factory=dict)
    loads_done: set[int] = field(default_factory=set)
    """Load jobs whose copies are over (landed or failed): their pins can go."""
    load_failures: dict[int, list[int]] = field(default_factory=dict)
    """Per load job, the vLLM block ids that did not load: vLLM recomputes them, and the
    scheduler saves them again (the store evidently lost them)."""
    corrupt: list[Location] = field(default_factory=list)
    """Loaded entries whose bytes did not match their checksum: the scheduler removes them."""
    failed_pools: set[PoolKey] = field(default_factory=set)
    """Pools a copy failed with: the scheduler's store backs off from them."""
    unvalidated_pools: set[PoolKey] = field(default_factory=set)
    """Pools whose published index this worker cannot read (another node): their unpinned loads
    failed, and the scheduler pins entries of them from now on."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UcmRayWorkerMetadata:
        assert isinstance(other, UcmRayWorkerMetadata)
        return UcmRayWorkerMetadata(saves={**self.saves, **other.saves},
                                    loads_done=self.loads_done | other.loads_done,
                                    load_failures={**self.load_failures, **other.load_failures},
                                    corrupt=self.corrupt + other.corrupt,
                                    failed_pools=self.failed_pools | other.failed_pools,
                                    unvalidated_pools=self.unvalidated_pools | other.unvalidated_pools)

    def is_empty(self) -> bool:
        return not (self.saves or self.loads_done or self.corrupt or self.failed_pools or self.unvalidated_pools)
