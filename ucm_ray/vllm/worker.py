"""The worker half of the connector: moves bytes, reports what happened, decides nothing.

Every location comes decided in the step's metadata (pins and slots are the
scheduler's). Copies are planned as arrays (``Ranges``: one range per block per
layer, never an object each). Per step, layer L's bytes land while layers < L
compute, and ``wait_for_layer_load`` makes layer L wait for them:

- **Stream-ordered pools** (shared memory, CUDA): the step's copies with each
  pool are planned once (``PoolConnections.prepare``: one gather plan, one index
  upload) and every layer is posted at once from the engine's own thread in
  ``start_load_kv``; ``wait_for_layer_load`` makes the compute stream wait for
  the layer's event, and the host checks every copy once, at the end of the
  loads. On an H200 the per-layer planning on a copy thread cost more host time
  than the copies took, and that thread fought the engine's for the GIL: a 4k
  store hit's step spent ~20 ms of host time on ~4 ms of PCIe.
- **Other pools** (CPU, where a post is the copy; NIXL): a copy thread posts
  layer after layer and ``wait_for_layer_load`` waits on the host.

``start_load_kv`` lands before the forward pass the loads that cannot wait for
layer hooks (mamba states, async hybrid loads, chunks shorter than the
FULL-CUDA-graph threshold, non-layerwise mode, and the hit's last block, into
whose tail vLLM writes the recomputed tokens before any hook runs): the host
waits for them, or on stream-ordered pools the compute stream does.

Saves are taken late: ``bind`` takes a job, every layer at once, of the attention
blocks that earlier steps filled (their KV is written, and nothing writes them
while their request runs). A copy thread's pools get it after the step's loads;
stream-ordered pools once the step's forward is queued (``wait_for_save``): the
host plans their copies while the device computes, not before the launch, and
the copies queue behind the compute stream's work so far, on their own stream.
On stream-ordered pools they move while the next steps compute: no step waits
for them, and at each hook the host looks,
without waiting, for jobs that landed (or missed their deadline) and reports
their results. The copy thread's saves are waited for at the end of their step
(that thread needs the GIL between copies: ``_poll_saves``), and only they: a job
with parts on both kinds of pool (a multi-node fleet's) lands once its
stream-ordered part has too. The
scheduler plans a request's saves once its first token is out, so neither the
copies nor the host work of saving delay a cold request's first token. (Saved in
the same step, layer by layer, a cold 4k-token request on an H200 took 2.1x as
long as without the connector, mostly host time per block and per layer.) Blocks
stay put while a save reads them: a finished request's blocks are kept until
the scheduler knows its saves landed, and a step that allocates a block again
(or loads into one) that a save may still be reading (its request was preempted)
names that job in its ``fences``: in ``handle_preemptions``, before vLLM zeroes
or copies into the step's new blocks, the current stream waits for it on the
device (the host, for a copy thread's pools). Mamba states are
saved after the forward that computes them, in ``wait_for_save``, and waited
for there: the next step overwrites them. Results go back per job through
``build_worker_meta``; the scheduler commits, frees and releases from them.

No control call (no Ray call) is made here, and the whole step is bounded by
one deadline (``transfer_timeout_s``): a hung pool can delay a forward pass by
at most that much, and whatever has not landed by then is a failed load
(vLLM recomputes) or a save that never becomes visible. (Stream-ordered copies
are kernels reading or writing mapped host memory: they cannot hang on a pool,
and the host waits for their events without a timeout.)
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from itertools import groupby, repeat

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.checksum import checksum
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.types import NO_CHECKSUM
from ucm_ray.transport.base import EMPTY, PoolDescriptor, PoolKey, PreparedCopies, Ranges, Transfer
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.compat import check_async_loads_reportable
from ucm_ray.vllm.layout import GroupLayout, base_buffers, build_layouts, entry_bytes
from ucm_ray.vllm.metadata import (
    BlockLoads,
    BlockSaves,
    LoadJob,
    SaveResult,
    UcmRayConnectorMetadata,
    UcmRayWorkerMetadata,
)
from ucm_ray.vllm.stats import UcmRayStats

log = logging.getLogger(__name__)

_Tag = tuple[int, int]
"""Which load a copy serves: (load job id, vLLM block id)."""


@dataclass
class _Entries:
    """One step's entries of one kv-cache group in one pool: the vLLM block each is copied to
    or from, where the entry starts in the pool, and the load each serves (saves fail or land
    per pool: they carry no tags)."""

    block_ids: np.ndarray
    pool_offsets: np.ndarray
    tags: list[_Tag]


_ByPool = dict[PoolKey, dict[int, _Entries]]
"""pool -> kv-cache group -> entries."""


def _group_tags(entries: _ByPool, group: int) -> set[_Tag]:
    """The jobs ``group``'s entries serve: the same for every layer of the group, so a step
    takes them once per group, not once per layer."""
    return {tag for by_group in entries.values() if group in by_group for tag in by_group[group].tags}


def _group_entries(pools: list[PoolKey], pool_of: np.ndarray, groups: np.ndarray, block_ids: np.ndarray,
                   offsets: np.ndarray, tags: list[_Tag] | None = None) -> _ByPool:
    """Entries given as columns (``pool_of``: index into ``pools``), split per pool and group,
    each in pool order (so a plan over every layer lists its ranges as the pool holds them).
    (The groups present by ``bincount``: ``np.unique``'s first call in a process imports
    ``numpy.ma``, ~10 ms of a fresh engine's first save or store hit.)"""
    out: _ByPool = {}
    for index, pool in enumerate(pools):
        in_pool = pool_of == index
        for g in np.flatnonzero(np.bincount(groups[in_pool])).tolist():
            rows = np.flatnonzero(in_pool & (groups == g))
            rows = rows[np.argsort(offsets[rows], kind="stable")]
            out.setdefault(pool, {})[g] = _Entries(block_ids[rows], offsets[rows],
                                                   [] if tags is None else [tags[i] for i in rows.tolist()])
    return out


def _load_entries(selected: list[tuple[BlockLoads, list[_Tag], np.ndarray]]) -> _ByPool:
    """The rows ``mask`` selects of each job's blocks (with its tags), per pool and group."""
    pools: dict[PoolKey, int] = {}
    columns: list[tuple[np.ndarray, ...]] = []
    tags: list[_Tag] = []
    for blocks, job_tags, mask in selected:
        rows = np.flatnonzero(mask)
        locations = blocks.locations
        to_step = np.asarray([pools.setdefault(pool, len(pools)) for pool in locations.pools], dtype=np.int64)
        columns.append((to_step[locations.pool[rows]], blocks.groups[rows], blocks.block_ids[rows],
                        locations.offset[rows]))
        tags.extend(job_tags[i] for i in rows.tolist())
    if not tags:
        return {}
    pool_of, groups, block_ids, offsets = (np.concatenate(column) for column in zip(*columns))
    return _group_entries(list(pools), pool_of, groups, block_ids, offsets, tags)


def _save_entries(saves: BlockSaves) -> _ByPool:
    """Every row (a replica of a block) of a save job, per pool and group."""
    locations = saves.locations
    return _group_entries(locations.pools, locations.pool, saves.groups, saves.block_ids, locations.offset)


@dataclass(frozen=True)
class _Batch:
    """What moves in one go: these layers ((group, index), in this order) of these entries. Its
    copies are planned as arrays (``_ranges``): when the copy thread runs it, or once per step
    for stream-ordered pools (``_prepare``)."""

    layers: tuple[tuple[int, int], ...]
    entries: _ByPool

    def tags(self) -> set[_Tag]:
        return self.tags_in(self.entries)

    def tags_in(self, pools: Collection[PoolKey]) -> set[_Tag]:
        """The jobs this batch serves through these pools."""
        groups = {g for g, _ in self.layers}
        return {tag for pool in pools for g, e in self.entries.get(pool, {}).items() if g in groups
                for tag in e.tags}

    def nbytes_by_pool(self, layouts: list[GroupLayout]) -> dict[PoolKey, int]:
        return {pool: sum(len(by_group[g].block_ids) * layouts[g].layers[i].block_bytes
                          for g, i in self.layers if g in by_group)
                for pool, by_group in self.entries.items()}


@dataclass
class _Posted:
    """A batch posted (or not: ``failed_pools``, ``failed``): what ``_land`` needs to see it
    land and take its failures."""

    batch: _Batch
    write: bool
    transfers: list[tuple[PoolKey, Transfer]] = field(default_factory=list)
    failed_pools: set[PoolKey] = field(default_factory=set)
    failed: bool = False
    """Nothing of the batch was posted (an error, or the step's deadline had passed)."""
    post_s: float = 0.0

    @property
    def failed_tags(self) -> set[_Tag]:
        return self.batch.tags() if self.failed else set()


@dataclass(eq=False)
class _SavesPosted:
    """A save job: batches on stream-ordered pools (posted once the step's forward is queued:
    ``ordered``), and the copy thread's tasks (handed to it after the step's loads, which must
    not queue behind them: ``threaded``). It lands when it lands: the host looks at each hook
    without waiting, and takes it as failed once ``deadline`` passed."""

    saves: BlockSaves
    layers: tuple[tuple[int, int], ...]
    posted: list[_Posted]
    futures: list[Future]
    threaded: _ByPool
    deadline: float
    ordered: _ByPool = field(default_factory=dict)
    """Entries on stream-ordered pools not posted yet. Planning them is host time (an 8B save's
    gather plans ~1-2 ms on an H200 host): before the forward's launch it held the device back,
    after it the host plans while the device computes. The blocks were written by earlier steps
    and no step writes them while their request runs, so the copies may follow the forward."""
    posted_at: float = field(default_factory=time.perf_counter)


_Prepared = dict[PoolKey, PreparedCopies | None]
"""A step's copies with each stream-ordered pool, planned once (None: that pool could not be)."""


@dataclass
class _StepState:
    loads: list[LoadJob] = field(default_factory=list)
    deadline: float = 0.0
    load_futures: dict[str, tuple[Future, set[_Tag]]] = field(default_factory=dict)  # layer -> copy-thread copies
    layer_loads: dict[str, _Posted] = field(default_factory=dict)  # layer -> stream-ordered copies, posted
    unlanded: list[_Posted] = field(default_factory=list)
    """Stream-ordered loads the compute stream waits for, not yet checked by the host."""
    tags: dict[int, list[_Tag]] = field(default_factory=dict)
    """Per load job, each of its blocks' tag (row order)."""
    failed: set[_Tag] = field(default_factory=set)
    state_saves: BlockSaves | None = None
    """This step's mamba states, saved after its forward."""
    crc: dict[_Tag, int] = field(default_factory=dict)
    """Running CRC32 of each loaded block whose entry has a checksum, taken as each of its layers
    landed (layer order), before the forward pass can write into the block's tail."""
    load_s: float = 0.0
    """Time spent posting and waiting for this step's loads (``load_seconds``)."""
    loads_posted: bool = False
    """Every load of the step was posted in ``start_load_kv`` (none awaits a layer hook). They
    are checked (landed, validated, reported) once the forward pass is queued, at the first of
    ``wait_for_save``, ``get_finished`` and ``get_block_ids_with_load_errors``: the compute
    stream waits for their bytes on the device, while the host launches the forward (checking
    them in ``start_load_kv`` held the forward's launch back for the whole copy: ~3 ms for a
    4k-token hit, ~11 ms for 16k on an H200)."""


class WorkerPart:
    def __init__(self, kv_cache_config, config: UcmRayConfig, tp_rank: int, node_id: str | None = None) -> None:
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._rank = tp_rank
        self._pools = PoolConnections(config.transport, node_id)
        self._indexes = IndexReaders(node_id)  # validates loads copied from unpinned entries
        check_async_loads_reportable(len(kv_cache_config.kv_cache_groups))
        self._group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        # Mamba / linear-attention layers get no per-layer hooks from vLLM.
        self._hooked_groups = {i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if isinstance(g.kv_cache_spec, AttentionSpec)}
        self._num_blocks = kv_cache_config.num_blocks
        self._layouts: list[GroupLayout] = []
        self._entry_sizes: np.ndarray = np.zeros(0, dtype=np.int64)  # per group: an entry's bytes (a load's size check)
        self._per_layer: np.ndarray = np.zeros(0, dtype=bool)  # per group: its layers have hooks
        self._buffers: tuple[torch.Tensor, ...] = ()  # the KV caches' allocations, as copies see them
        self._buffer_of: dict[str, int] = {}  # layer name -> its index in ``_buffers``
        self._device = torch.device("cpu")
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, index in group)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="ucm-ray-copy")
        self._idle_step = _StepState()  # the state of every step without loads or state saves
        self._step = self._idle_step
        self._saving: list[_SavesPosted] = []
        """Save jobs posted, not yet seen landed (oldest first): they outlive their step."""
        self._fenced: UcmRayConnectorMetadata | None = None  # the step whose fences are in place
        self._results = UcmRayWorkerMetadata()
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._failed_recving: set[str] = set()
        self.stats = UcmRayStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._device = next(iter(kv_caches.values())).device
        self._layouts = build_layouts(kv_caches, self._group_layers, self._num_blocks)
        for gl in self._layouts:
            planned = entry_bytes(self._kv_cache_config, gl.group)
            if gl.layers and gl.entry_bytes != planned:
                raise ValueError(f"ucm-ray: kv-cache group {gl.group} holds {gl.entry_bytes} bytes per block "
                                 f"here but its spec says {planned}; this layout is not supported")
        self._layer_of = {layer.name: (gl.group, i) for gl in self._layouts for i, layer in enumerate(gl.layers)}
        self._entry_sizes = np.asarray([gl.entry_bytes for gl in self._layouts], dtype=np.int64)
        self._per_layer = np.asarray([gl.group in self._hooked_groups for gl in self._layouts], dtype=bool)
        self._buffers = tuple(base_buffers(kv_caches))
        at = {buf.data_ptr(): i for i, buf in enumerate(self._buffers)}
        self._buffer_of = {layer.name: at[layer.storage_address] for gl in self._layouts for layer in gl.layers}
        for buf in self._buffers:
            self._pools.register_local(buf)
        log.info("ucm-ray worker rank %d: %s", self._rank,
                 ", ".join(f"group {gl.group}: {len(gl.layers)} layers x {gl.layers[0].block_bytes if gl.layers else 0}"
                           f" B/block" for gl in self._layouts))

    def open_pools(self, pools: Mapping[PoolKey, PoolDescriptor] | None) -> None:
        """Open the fleet's pools (mapped whole; on CUDA page-locked too, ~0.3 s a GiB) and their
        published indexes as the engine starts (``pools``: the directory's list; None where
        none answered). Left to the first step's metadata, opening was paid by a fresh
        engine's first store hit: 132 ms of its TTFT with two 512 MiB pools on a 2-core CPU box,
        seconds with a GPU host's pools. The first step's metadata still decides what stays open
        (a pool restarted meanwhile is closed and its new incarnation opened then)."""
        if not pools:
            return
        self._adopt_pools(pools)
        self._open_pools()

    def _adopt_pools(self, pools: Mapping[PoolKey, PoolDescriptor]) -> None:
        """Make ``pools`` the current ones for copies and for validating unpinned loads (old
        incarnations' mappings are closed here, before any copy)."""
        self._pools.sync(pools)
        self._indexes.sync(pools)

    # --- per step ------------------------------------------------------------------------

    def bind(self, meta: UcmRayConnectorMetadata) -> None:
        if self._step.loads_posted:
            # No results were asked for since the last step posted them: its execution failed,
            # and its output with it. Land them (their blocks may be reused now); their block
            # ids are not vLLM's to redo in this step, so failures go to the scheduler only.
            log.warning("ucm-ray: a step's loads were never reported to vLLM (its execution failed?)")
            self._finish_posted_loads(to_vllm=False)
        self._poll_saves(step_end=False)
        if meta.pools is not None:
            self._land_every_save()  # no copy may still use a mapping that closes now
            self._adopt_pools(meta.pools)
            self._copier.submit(self._open_pools)  # ahead of this step's copies, on their thread
        # the scheduler learned that their saves landed: vLLM may free their blocks now
        self._finished_sending |= meta.saved_requests
        self.fence(meta)  # where vLLM did not call ``handle_preemptions`` first
        saves, states = meta.saves.get(self._rank), meta.state_saves.get(self._rank)
        deadline = time.monotonic() + self._config.transfer_timeout_s
        loads, state_saves = meta.loads.get(self._rank), states if states is not None and len(states) else None
        # A step that loads nothing and saves no state (most decode steps) never writes into its
        # state: they share one, made once (a new one cost every such step ~2 us of host time).
        self._step = _StepState(loads=loads or [], deadline=deadline, state_saves=state_saves) \
            if loads or state_saves is not None else self._idle_step
        if saves is not None and len(saves):
            self._saving.append(self._post_saves(saves, deadline, ordered_later=True))

    def start_load_kv(self) -> None:
        step = self._step
        if step.loads:
            self._start_loads()
        for saves in self._saving:
            self._hand_to_copier(saves)

    def _start_loads(self) -> None:
        step = self._step
        layered: list[tuple[BlockLoads, list[_Tag], np.ndarray]] = []
        immediate: list[tuple[BlockLoads, list[_Tag], np.ndarray]] = []
        for job in step.loads:
            blocks = job.blocks
            tags = step.tags[job.job_id] = list(zip(repeat(job.job_id), blocks.block_ids.tolist()))
            sized = blocks.locations.size == self._entry_sizes[blocks.groups]
            for row in np.flatnonzero(~sized).tolist():
                log.error("entry for block %d has %d bytes, layout expects %d: not loaded", blocks.block_ids[row],
                          blocks.locations.size[row], self._entry_sizes[blocks.groups[row]])
                step.failed.add(tags[row])
            for row in np.flatnonzero(sized & (blocks.locations.checksum != NO_CHECKSUM)).tolist():
                step.crc[tags[row]] = 0
            hooks = self._config.layerwise and not job.complete_in_start and not job.is_async
            per_layer = sized & self._per_layer[blocks.groups] & ~blocks.before_forward if hooks \
                else np.zeros(len(blocks), bool)
            layered.append((blocks, tags, per_layer))
            immediate.append((blocks, tags, sized & ~per_layer))
        every_layer = tuple((gl.group, i) for gl in self._layouts for i in range(len(gl.layers)))
        at_once, at_once_threaded = self._split(_load_entries(immediate))
        by_layer, by_layer_threaded = self._split(_load_entries(layered))
        # e.g. vLLM zeroing fresh blocks, queued before us (stream-ordered posts queue behind it)
        ready = self._compute_ready() if at_once_threaded or by_layer_threaded else None
        # Loads that cannot wait for layer hooks go first on every pool's stream or thread (the
        # layer loads would delay them), and are waited for once the layer loads are posted too.
        first: _Posted | None = None
        if at_once:
            first, = self._post_by_pool(at_once, [every_layer], write=False)
        first_threaded: tuple[Future, set[_Tag]] | None = None
        if at_once_threaded:
            batch = _Batch(every_layer, at_once_threaded)
            first_threaded = (self._copier.submit(self._move, step.deadline, batch, False, ready), batch.tags())
        layers = [(gl.group, i, layer.name) for gl in self._layouts
                  if any(gl.group in by_group for by_group in (*by_layer.values(), *by_layer_threaded.values()))
                  for i, layer in enumerate(gl.layers)]
        if by_layer:  # every layer posted now, from this thread; the compute stream waits per layer
            step.layer_loads = dict(zip([name for _, _, name in layers],
                                        self._post_by_pool(by_layer, [((g, i),) for g, i, _ in layers], write=False)))
        group_tags = {g: _group_tags(by_layer_threaded, g) for by_group in by_layer_threaded.values() for g in by_group}
        per_layer = [(name, _Batch(((g, i),), by_layer_threaded), group_tags[g])
                     for g, i, name in layers if g in group_tags]
        if per_layer and self._device.type == "cuda":  # NIXL: a post only queues the transfer
            # One task posts every layer, each layer's future set as soon as it is posted (a
            # task per layer cost its hand-off per layer, and the link idled meanwhile).
            posted: list[Future] = [Future() for _ in per_layer]
            self._copier.submit(self._move_each, step.deadline, [batch for _, batch, _ in per_layer], ready, posted)
            step.load_futures = {name: (future, tags) for (name, _, tags), future in zip(per_layer, posted)}
        elif per_layer:  # a post is the copy itself: one task per layer, each waited for as it lands
            step.load_futures = {name: (self._copier.submit(self._move, step.deadline, batch, False, ready), tags)
                                 for name, batch, tags in per_layer}
        if first is not None:
            # the forward waits for them from its first kernel (checksums read them on the host)
            if step.crc or not self._order_compute(first):
                self._land(first)
            else:
                step.unlanded.append(first)
        if first_threaded is not None:
            self._wait(*first_threaded)
        batches = [_Batch(((g, i),), {**by_layer, **by_layer_threaded}) for g, i, _ in layers]
        if at_once or at_once_threaded:
            batches.append(_Batch(every_layer, {**at_once, **at_once_threaded}))
        self._count_bytes(batches, "loaded")
        step.loads_posted = not step.load_futures and not step.layer_loads

    def _finish_posted_loads(self, *, to_vllm: bool = True) -> None:
        """``_finish_loads`` for loads that were all posted in ``start_load_kv`` (``loads_posted``)."""
        if self._step.loads_posted:
            self._step.loads_posted = False
            self._finish_loads(to_vllm=to_vllm)

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        threaded = step.load_futures.pop(layer_name, None)
        if threaded is not None:
            self._wait(*threaded)
        ordered = step.layer_loads.pop(layer_name, None)
        if ordered is not None:
            # checksums read each layer's blocks as they land: the host waits for those
            if step.crc or not self._order_compute(ordered):
                self._land(ordered)
            else:
                step.unlanded.append(ordered)
        if (threaded or ordered) and not step.load_futures and not step.layer_loads:
            self._finish_loads()

    def wait_for_save(self) -> None:
        for saves in self._saving:  # the forward is queued: the host plans them while it runs
            self._post_ordered(saves)
        self._finish_posted_loads()
        step = self._step
        unwaited = set(step.load_futures) | set(step.layer_loads)
        if unwaited:
            # Layer loads whose hook never ran: the forward pass did not wait for their bytes (a
            # FULL CUDA graph replay runs no Python). Its output cannot be trusted, so the loads
            # are failed and vLLM drops this step's tokens and recomputes: wrong tokens stay
            # impossible even if the hit policy let such a step through.
            log.warning("ucm-ray: %d layer load(s) were never waited for by the forward pass; "
                        "failing them so vLLM recomputes", len(unwaited))
            self.stats.add(unwaited_layer_loads=len(unwaited))
            for future, tags in list(step.load_futures.values()):
                self._wait(future, tags)  # the copies must be over before the blocks are reused
                step.failed |= tags
            for posted in step.layer_loads.values():
                self._land(posted)
                step.failed |= posted.batch.tags()
            step.load_futures.clear()
            step.layer_loads.clear()
            self._finish_loads()
        if step.state_saves is not None:
            self._land_saves(self._post_saves(step.state_saves, step.deadline))
            step.state_saves = None
        self._poll_saves(step_end=True)

    def build_worker_meta(self) -> UcmRayWorkerMetadata | None:
        self._poll_saves(step_end=True)
        if self._results.is_empty():
            return None  # most decode steps: nothing allocated, nothing for vLLM to carry
        out, self._results = self._results, UcmRayWorkerMetadata()
        return out

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending: their saves landed, finished receiving, of which failed)."""
        self._finish_posted_loads()
        self._poll_saves(step_end=True)
        sending, done, failed = self._finished_sending, self._finished_recving, self._failed_recving
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return sending, done | failed, failed

    def load_errors(self) -> set[int]:
        self._finish_posted_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._land_every_save()
        self._copier.shutdown(wait=True)
        self._pools.close()
        self._indexes.close()

    # --- helpers -------------------------------------------------------------------------

    def _wait(self, future: Future, tags: set[_Tag]) -> None:
        """Wait for a copy task's batch to be posted, then to land (``_land``), within what is
        left of the step's deadline."""
        started = time.perf_counter()
        posted = self._posted_by_deadline(future, self._step.deadline)
        if posted is None:
            self._step.failed |= tags
            return
        self._land(posted, started)

    def _posted_by_deadline(self, future: Future, deadline: float) -> _Posted | None:
        """A copy task's batch once posted, or None when ``deadline`` passed first (the task is
        cancelled unless it already runs; one not ``cancelled()`` may still land)."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            future.cancel()
            log.error("ucm-ray: copies of step missed the %.1f s deadline; treated as failed",
                      self._config.transfer_timeout_s)
            self.stats.add(deadline_misses=1)
            return None

    def _post_saves(self, saves: BlockSaves, deadline: float, *, ordered_later: bool = False) -> _SavesPosted:
        """A save job, every layer of its blocks at once: one batch per pool, queued behind the
        compute stream's work so far (which wrote the blocks); ``ordered_later``: its
        stream-ordered pools' batches wait for ``_post_ordered`` (after the step's forward)."""
        entries = _save_entries(saves)
        layers = tuple((gl.group, i) for gl in self._layouts
                       if any(gl.group in by_group for by_group in entries.values()) for i in range(len(gl.layers)))
        ordered, threaded = self._split(entries)
        out = _SavesPosted(saves, layers, [], [], threaded, deadline, ordered)
        if not ordered_later:
            self._post_ordered(out)
        self._count_bytes([_Batch(layers, entries)], "saved")
        return out

    def _post_ordered(self, saves: _SavesPosted) -> None:
        """Post a save job's batches on stream-ordered pools, if not yet posted."""
        if saves.ordered:
            ordered, saves.ordered = saves.ordered, {}
            saves.posted += self._post_by_pool(ordered, [saves.layers], write=True)

    def _hand_to_copier(self, saves: _SavesPosted) -> None:
        """The copy thread's part of a save job, once the step's loads are queued there."""
        if saves.threaded:
            batch = _Batch(saves.layers, saves.threaded)
            saves.futures.append(self._copier.submit(self._move, saves.deadline, batch, True, self._compute_ready()))
            saves.threaded = {}

    def _poll_saves(self, *, step_end: bool) -> None:
        """Take the results of the save jobs that landed (or missed their deadline) since the
        last look, without waiting for those on stream-ordered pools: the engine's steps go on
        while they move. At the end of a step (``step_end``) the host waits for the copy
        thread's part of its jobs: that thread needs the GIL between its copies, and an engine
        thread that runs Python meanwhile hands it over only every switch interval (5 ms), so a
        save of 18 blocks took hundreds of steps to land; waiting, the host lets it run. In
        paranoid mode (``checksum``) every job lands before its step ends: its checksum is taken
        from vLLM's blocks, which must still hold what was saved."""
        if not self._saving:
            return  # most decode steps
        for saves in self._saving:  # a step without ``start_load_kv`` (one that runs no tokens)
            self._hand_to_copier(saves)
            self._post_ordered(saves)  # this step's forward is queued (or, at ``bind``, the last one's)
        if step_end and not self._config.checksum:
            for saves in self._saving:
                self._wait_threaded(saves)
        now = time.monotonic()
        landing = [saves for saves in self._saving
                   if (step_end and self._config.checksum) or now >= saves.deadline or self._saves_done(saves)]
        for saves in landing:
            self._land_saves(saves)
        if landing:
            self._saving = [saves for saves in self._saving if saves not in landing]

    def _wait_threaded(self, saves: _SavesPosted) -> None:
        """Wait (within the job's deadline) for the copy thread's part of a save job, posts and
        transfers, and not for its stream-ordered part: that part is queued after the step's
        forward, so waiting for it (landing the job at step end) held the host for the whole
        forward. A failure or a missed deadline is taken when the job lands (a transfer's
        ``wait`` may be called again)."""
        for future in saves.futures:
            try:
                posted = future.result(timeout=max(0.0, saves.deadline - time.monotonic()))
            except FutureTimeout:
                return  # past its deadline: it lands (failed) in this poll
            for _, transfer in posted.transfers:
                with suppress(Exception):
                    transfer.wait(max(0.0, saves.deadline - time.monotonic()))

    def _land_every_save(self) -> None:
        """Wait for every save job still copying (the pools' mappings are about to change)."""
        for saves in self._saving:
            self._land_saves(saves)
        self._saving = []

    def fence(self, meta: UcmRayConnectorMetadata) -> None:
        """This step reuses blocks that these save jobs may still be reading (freed and
        allocated again, say to a preempted request's successor): whatever writes them must
        come after the copies. vLLM calls ``handle_preemptions`` (this) before it zeroes or
        copies into the step's new blocks, and before the forward and the step's loads. The
        current stream waits for stream-ordered copies on the device; the host waits for the
        copy thread's."""
        if meta is self._fenced:
            return  # ``handle_preemptions`` did, before ``bind``
        self._fenced = meta
        fenced = [saves for saves in self._saving if saves.saves.job_id in meta.fences]
        if not fenced:
            return
        self.stats.add(save_fences=len(fenced))
        for saves in fenced:
            self._post_ordered(saves)
        host = [saves for saves in fenced
                if saves.futures or saves.threaded or not all([self._order_compute(p) for p in saves.posted])]
        for saves in host:
            self._land_saves(saves)
        self._saving = [saves for saves in self._saving if saves not in host]

    def _saves_done(self, saves: _SavesPosted) -> bool:
        """Whether every copy of a save job is over (never waits)."""
        if saves.threaded or saves.ordered or not all(future.done() for future in saves.futures):
            return False
        batches = saves.posted + [future.result() for future in saves.futures if not future.cancelled()]
        try:
            return all(transfer.done() for batch in batches for _, transfer in batch.transfers)
        except Exception:  # noqa: BLE001 -- a failed transfer is over; ``_land_saves`` takes its error
            return True

    def _land_saves(self, saves: _SavesPosted) -> None:
        """Wait (within the job's deadline) for a save job's copies; its result per row."""
        self._hand_to_copier(saves)
        self._post_ordered(saves)
        posted, failed, uncertain = list(saves.posted), False, False
        for future in saves.futures:
            batch = self._posted_by_deadline(future, saves.deadline)
            if batch is None:
                failed = True
                uncertain = uncertain or not future.cancelled()  # running: it may still land later
            else:
                posted.append(batch)
        failed_pools: set[PoolKey] = set()
        for batch in posted:
            failed = failed or batch.failed
            failed_pools |= batch.failed_pools | self._pools.wait(
                batch.transfers, write=True, timeout_s=max(0.0, saves.deadline - time.monotonic()))
        self._results.failed_pools |= failed_pools
        job, locations = saves.saves, saves.saves.locations
        pool_failed = np.asarray([pool in failed_pools for pool in locations.pools] + [True], dtype=bool)
        landed = np.zeros(len(job), dtype=bool) if failed else ~pool_failed[locations.pool]
        sums = self._entry_checksums(job, landed) if self._config.checksum and landed.any() else None
        self._results.saves[job.job_id] = SaveResult(landed, sums, uncertain=uncertain)
        self.stats.add(save_failures=int((~landed).sum()))
        self.stats.observe("save_seconds", time.perf_counter() - saves.posted_at)

    def _land(self, posted: _Posted, since: float | None = None) -> None:
        """Wait on the host for a posted batch to land and take its failures (``since``: when
        the wait began, if it began before its post was in)."""
        step = self._step
        started = time.perf_counter() if since is None else since
        failed_pools = posted.failed_pools | self._pools.wait(
            posted.transfers, write=posted.write, timeout_s=max(0.0, step.deadline - time.monotonic()))
        step.load_s += posted.post_s + time.perf_counter() - started
        self._results.failed_pools |= failed_pools
        step.failed |= posted.failed_tags | posted.batch.tags_in(failed_pools)
        if not posted.write and step.crc:
            self._update_checksums(posted.batch, failed_pools)

    def _order_compute(self, posted: _Posted) -> bool:
        """Make the compute stream wait for ``posted`` on the device; False if some transfer
        needs the host to wait (then ``_land`` must be called now)."""
        stream = torch.cuda.current_stream(self._device)
        return all([transfer.order_stream(stream) for _, transfer in posted.transfers])

    def _split(self, entries: _ByPool) -> tuple[_ByPool, _ByPool]:
        """(stream-ordered pools' entries, the copy thread's)."""
        ordered = {pool: e for pool, e in entries.items() if self._pools.stream_ordered(pool, self._device)}
        return ordered, {pool: e for pool, e in entries.items() if pool not in ordered}

    def _prepared(self, entries: _ByPool, parts: list[tuple[tuple[int, int], ...]], *,
                  write: bool) -> Iterator[_Prepared]:
        """The step's copies, one pool at a time (each planned once, part k being the layers
        ``parts[k]``); the ranges of every pool are computed together first."""
        every = tuple(layer for part in parts for layer in part)
        try:
            plans = self._ranges(_Batch(every, entries), by_entry=len(parts) == 1)
        except Exception:  # noqa: BLE001 -- every pool's copies fail, nothing reaches vLLM
            log.exception("ucm-ray: planning a step's %s failed", "saves" if write else "loads")
            yield {pool: None for pool in entries}
            return
        for pool, by_group in entries.items():
            counts = [sum(len(by_group[g].block_ids) * self._layouts[g].segment_count(i)
                          for g, i in part if g in by_group) for part in parts]
            yield {pool: self._pools.prepare(pool, plans.get(pool, EMPTY), np.cumsum(counts).tolist(), write=write)}

    def _post_by_pool(self, entries: _ByPool, parts: list[tuple[tuple[int, int], ...]], *,
                      write: bool) -> list[_Posted]:
        """Plan and post every part (``parts[k]``: its layers) of ``entries``; one posted batch
        per part, over every pool. One part (a save, or every layer at once) is posted pool by
        pool as each is planned, so a pool's bytes move while the next one's gather plan is
        built (~1-2 ms a pool for a 16k-token hit on an H200 host). Layer by layer, every pool is
        planned first and layer k is posted on every pool before layer k + 1, so the first
        layers land first."""
        posted = [_Posted(_Batch(layers, entries), write) for layers in parts]
        if len(parts) == 1:
            for copies in self._prepared(entries, parts, write=write):
                self._post_parts(copies, posted)
        else:
            self._post_parts({pool: c for copies in self._prepared(entries, parts, write=write)
                              for pool, c in copies.items()}, posted)
        return posted

    def _post_parts(self, copies: _Prepared, posted: list[_Posted]) -> None:
        """Post part k of ``copies`` (every pool in it) into ``posted[k]``, in order of k."""
        for part, out in enumerate(posted):
            started = time.perf_counter()
            transfers, failed = self._pools.post_part(copies, part, write=out.write)
            out.transfers += transfers
            out.failed_pools |= failed
            out.post_s += time.perf_counter() - started

    def _count_bytes(self, batches: list[_Batch], what: str) -> None:
        """``loaded_copy_bytes`` and ``loaded_shm_bytes``, ``saved_nixl_bytes``, ...: how much,
        and which path the bytes took (a step's load batches counted together)."""
        by_pool: dict[PoolKey, int] = defaultdict(int)
        for batch in batches:
            for pool, nbytes in batch.nbytes_by_pool(self._layouts).items():
                by_pool[pool] += nbytes
        self.stats.add(**{f"{what}_copy_bytes": sum(by_pool.values())})
        for pool, nbytes in by_pool.items():
            self.stats.add(**{f"{what}_{self._pools.kind(pool)}_bytes": nbytes})

    def _ranges(self, batch: _Batch, *, by_entry: bool = False) -> dict[PoolKey, Ranges]:
        """The batch's copies per pool: per layer (in the batch's order), every entry's segments,
        as arrays; each run of one group's layers in one pass (``by_entry``: the run's layers
        entry by entry, for a batch moved as one part)."""
        runs = [(g, [i for _, i in run]) for g, run in groupby(batch.layers, key=lambda layer: layer[0])]
        out = {}
        for pool, by_group in batch.entries.items():
            parts = [self._layouts[g].ranges(indices, by_group[g].block_ids, by_group[g].pool_offsets, self._buffers,
                                             [self._buffer_of[self._layouts[g].layers[i].name] for i in indices],
                                             by_entry=by_entry)
                     for g, indices in runs if g in by_group]
            if parts:
                out[pool] = Ranges.concat(parts)
        return out

    def _entry_checksums(self, saves: BlockSaves, landed: np.ndarray) -> np.ndarray:
        """Per row, CRC32 of the entry as its bytes lie in the pool (layers in order, segments
        in order), taken once per block (its replicas share it); NO_CHECKSUM where not landed."""
        out: np.ndarray = np.full(len(saves), NO_CHECKSUM, dtype=np.int64)
        done: dict[tuple[int, int], int] = {}
        for row in np.flatnonzero(landed).tolist():
            block = (int(saves.groups[row]), int(saves.block_ids[row]))
            if block not in done:
                value = 0
                for layer in self._layouts[block[0]].layers:
                    for seg in layer.segments(block[1]):
                        value = checksum(seg, value)
                done[block] = value
            out[row] = done[block]
        return out

    def _open_pools(self) -> None:
        """Copy-thread task: open every current pool (mapped, page-locked) under this worker's
        device, as the copies that will use them run."""
        with torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext():
            self._pools.open_all()

    def _compute_ready(self) -> torch.cuda.Event | None:
        """On CUDA, an event after the work queued so far on the compute stream: a side-stream
        copy must not read a layer's KV before its attention wrote it, nor load into a block
        before vLLM's zeroing of fresh blocks ran."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _move(self, deadline: float, batch: _Batch, write: bool, ready: torch.cuda.Event | None = None) -> _Posted:
        """Copy-thread task: post one batch per pool and return without waiting for them to land
        (``_wait`` does, where the bytes are needed), so the next layer is planned and posted
        while this one moves. Any exception fails the whole batch instead of reaching vLLM, and
        nothing starts once ``deadline`` passed (its loads were reported failed by then)."""
        started = time.perf_counter()
        try:
            # vLLM's KV caches are inference tensors; the copy thread is ours and starts on device 0.
            device = torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext()
            with torch.inference_mode(), device:
                if ready is not None:
                    ready.synchronize()
                if time.monotonic() >= deadline:
                    return _Posted(batch, write, failed=True)
                started = time.perf_counter()
                transfers, failed_pools = self._pools.post(self._ranges(batch), write=write)
                return _Posted(batch, write, transfers, failed_pools, post_s=time.perf_counter() - started)
        except Exception:
            log.exception("ucm-ray: a %s batch failed on the copy thread", "save" if write else "load")
            return _Posted(batch, write, failed=True, post_s=time.perf_counter() - started)

    def _move_each(self, deadline: float, batches: list[_Batch], ready: torch.cuda.Event | None,
                   posted: list[Future]) -> None:
        """Copy-thread task: load ``batches`` in order, setting each one's future once posted. A
        future ``_wait`` gave up on before its turn (the deadline) is cancelled: skipped."""
        for batch, future in zip(batches, posted):
            if future.set_running_or_notify_cancel():
                future.set_result(self._move(deadline, batch, False, ready))

    def _update_checksums(self, batch: _Batch, failed_pools: set[PoolKey]) -> None:
        """Layer order, block by block: only entries that carry a checksum."""
        step = self._step
        for g, i in batch.layers:
            for pool, by_group in batch.entries.items():
                if pool in failed_pools or g not in by_group:
                    continue
                for block_id, tag in zip(by_group[g].block_ids.tolist(), by_group[g].tags):
                    if tag in step.crc:
                        for seg in self._layouts[g].layers[i].segments(block_id):
                            step.crc[tag] = checksum(seg, step.crc[tag])

    def _validate_unpinned(self) -> None:
        """Loads copied from entries nobody pinned (found in a published index) count only if the
        entry is still listed as it was: otherwise its slot may have been reused mid-copy."""
        step = self._step
        for job in step.loads:
            tags, locations = step.tags[job.job_id], job.blocks.locations
            rows = np.flatnonzero(locations.generation)
            if step.failed:
                rows = rows[[tags[row] not in step.failed for row in rows.tolist()]]
            if not len(rows):
                continue
            stale, unreadable = self._indexes.stale(locations, job.blocks.keys, rows)
            self._results.unvalidated_pools |= unreadable
            step.failed.update(tags[row] for row in rows[stale].tolist())
            self.stats.add(stale_loads=int(stale.sum()))

    def _finish_loads(self, *, to_vllm: bool = True) -> None:
        """All copies of the step are in: validate unpinned ones, verify checksums and report
        what vLLM must redo (``to_vllm``: the failed blocks of synchronous loads go to vLLM,
        which it may only be told in the step that loaded them)."""
        step = self._step
        for posted in step.unlanded:
            self._land(posted)
        step.unlanded = []
        self._validate_unpinned()
        for job in step.loads:
            tags, locations = step.tags[job.job_id], job.blocks.locations
            for row in np.flatnonzero(locations.checksum != NO_CHECKSUM).tolist():
                if tags[row] not in step.failed and step.crc.get(tags[row]) != locations.checksum[row]:
                    location = locations[row]
                    assert location is not None
                    log.error("ucm-ray: checksum mismatch for block %d of %s (shard %s): recomputed",
                              tags[row][1], job.req_id, location.shard_id)
                    self.stats.add(checksum_mismatches=1)
                    step.failed.add(tags[row])
                    self._results.corrupt.append(location)
        for job in step.loads:
            tags = step.tags[job.job_id]
            bad = [tag[1] for tag in tags if tag in step.failed] if step.failed else []
            if job.is_async:
                (self._failed_recving if bad or job.failed else self._finished_recving).add(job.req_id)
            elif to_vllm:
                self._load_errors.update(bad)
            self._results.loads_done.add(job.job_id)
            if bad:
                self._results.load_failures[job.job_id] = bad
            self.stats.add(loaded_blocks=len(job.blocks) - len(bad), load_failures=len(bad))
        if step.loads:
            self.stats.observe("load_seconds", step.load_s)
        step.loads = []
