"""Copy execution: posting batches to the pools and waiting for them, within a deadline.

Two kinds of pool take copies differently. Stream-ordered pools (shared memory mapped for
CUDA) take every layer of a step planned at once and posted from the engine's own thread (a
load layer by layer a few layers ahead of its hooks: ``PartPosts``), and the compute stream
waits for each layer's event: planning layer by layer on another thread cost more host time
than the copies and fought the engine's thread for the GIL. The other pools (CPU, where a
post is the copy itself; NIXL) get their batches from one copy thread, and the host waits for
them. Whatever has not been posted or landed by the step's deadline is failed: a hung pool
delays a forward pass by one deadline at most.
(Stream-ordered copies are kernels reading or writing mapped host memory: they cannot hang on
a pool, and the host waits for their events without a timeout.)
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch

from ucm_ray.transport.base import (
    EMPTY,
    LateReadError,
    PoolDescriptor,
    PoolKey,
    PreparedCopies,
    Ranges,
    RepeatedRanges,
    Transfer,
    still_late,
)
from ucm_ray.transport.pools import Failures, PoolConnections
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker.plan import Batch, ByPool, Entries, KvCaches, Layer, Tag, split_entries

log = logging.getLogger(__name__)

REPEAT_AT_ONCE_RANGES = 256
"""A load at once (every layer before the forward) whose one layer's ranges number at least this
is planned as one layer's ranges repeated and posted as one transfer of every layer: a 256-block
8B load's ranges, check and plan took 1.5 ms of a CPU box's host time over every layer's 16,384
ranges and 0.3 ms as one layer's 512 repeated. Below it a post per layer (a DMA copy and a
scatter each) costs more than the smaller plan saves."""


def part_ends(caches: KvCaches, by_group: dict[int, Entries], parts: list[tuple[Layer, ...]],
              ranges: Ranges) -> list[int]:
    """Where each part's ranges end among one pool's ``ranges`` (those of ``by_group``'s entries
    over ``parts``, part after part). One part (a save, a load at once) ends with the ranges:
    counting its layers' segments cost a decode step's save ~6 us of a CPU box's host time per
    pool."""
    if len(parts) == 1:
        return [len(ranges)]
    return np.cumsum(caches.segment_counts(by_group, parts)).tolist()


@dataclass
class Posted:
    """A batch posted (or not: ``failed_pools``, ``failed``): what a wait needs to see it land
    and take its failures."""

    batch: Batch
    write: bool
    transfers: list[tuple[PoolKey, Transfer]] = field(default_factory=list)
    failed_pools: set[PoolKey] = field(default_factory=set)
    failed: bool = False
    """Nothing of the batch was posted (an error, or the step's deadline had passed)."""
    post_s: float = 0.0

    @property
    def failed_tags(self) -> set[Tag]:
        return self.batch.tags() if self.failed else set()


Prepared = dict[PoolKey, PreparedCopies | None]
"""A step's copies with each stream-ordered pool, planned once (None: that pool could not be)."""


@dataclass
class PartPosts:
    """A step's copies in parts (a layer each), planned once on every pool and posted in part
    order a few at a time (``Copier.post_through``): a load layer by layer posts its first
    layers in ``start_load_kv`` and each later one from an earlier layer's hook."""

    prepared: Prepared
    posted: list[Posted]
    """Part k's batch: posted once k < ``next``."""
    next: int = 0
    """The first part not posted yet."""

    def drop(self) -> list[Posted]:
        """The parts not posted yet, now never to be (their plan let go): no copy of theirs runs."""
        unposted, self.next = self.posted[self.next:], len(self.posted)
        self.prepared = {}
        return unposted


def _late_read_stop(what: str, timeout_s: float) -> LateReadError:
    """The worker's ``LateReadError``, one line that names the shards and what to do: vLLM ends
    the engine on it, and its client and operator see little else (vLLM's OpenAI server answers
    500 "EngineCore encountered an issue" and exits 0). ``what``: the reads still in flight, and
    from which shards."""
    return LateReadError(f"ucm-ray: stopping this engine: {what} still in flight {timeout_s:g} s after its step "
                         "gave up on it (a shard paused or unreachable); NIXL cannot cancel a read, and it would "
                         "write KV blocks vLLM reuses. Check the shard (ucm-ray status) and restart the engine; "
                         "nixl_stage_through_host: on lands such reads in a host buffer instead")


def _abandon(future: Future[Posted]) -> None:
    """A copy task's batch that nobody waits for: its transfers deliver nothing more."""
    for _, transfer in future.result().transfers:
        transfer.abandon()


class Copier:
    """Posts batches and waits for them: stream-ordered pools from the calling thread, the
    others from one copy thread. Makes no control call. ``clock``: the worker's time, which its
    step deadlines are on (the host's; a test's own lets it decide when a deadline passes,
    whatever the host's load: a wait on the host is still given at most what is left of it)."""

    def __init__(self, pools: PoolConnections, transfer_timeout_s: float, stats: UcmRayStats, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pools = pools
        self._timeout_s = transfer_timeout_s
        self._stats = stats
        self.clock = clock
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ucm-ray-copy")
        self.caches = KvCaches.unregistered()
        self.late_reads: list[tuple[PoolKey, Transfer] | Future[Posted]] = []
        """Failed reads whose bytes may still land in their KV blocks (``Transfer.late``), and loads'
        copy tasks a step gave up on while they ran (what they post may; ``load_by_deadline``):
        ``fence_late_reads`` empties it. One list, never replaced: the hooks test it as it is, a
        quiet step pays nothing more."""
        self._quarantines = 0
        """``HostStaging.quarantines`` as last counted in the stats."""

    # --- set-up --------------------------------------------------------------------------

    def register(self, caches: KvCaches) -> None:
        """The KV caches vLLM registered: copies read and write them (registered with the pools)."""
        self.caches = caches
        for buffer in caches.buffers:
            self._pools.register_local(buffer)

    def sync(self, pools: Mapping[PoolKey, PoolDescriptor]) -> None:
        """Make ``pools`` the current ones (old incarnations' mappings are closed here)."""
        self._pools.sync(pools)

    def open_pools(self) -> None:
        """Open every current pool (mapped, page-locked) under this worker's device."""
        with self._on_device():
            self._pools.open_all()

    def open_pools_later(self) -> None:
        """``open_pools`` on the copy thread, ahead of the copies queued after it."""
        self._thread.submit(self.open_pools)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        self._pools.close()

    # --- streams -------------------------------------------------------------------------

    def stream_ordered(self, pool: PoolKey) -> bool:
        return self._pools.stream_ordered(pool, self.caches.device)

    def split(self, entries: ByPool) -> tuple[ByPool, ByPool]:
        """(stream-ordered pools' entries, the copy thread's)."""
        return split_entries(entries, self.stream_ordered)

    def compute_ready(self) -> torch.cuda.Event | None:
        """On CUDA, an event after the work queued so far on the compute stream: a side-stream
        copy must not read a layer's KV before its attention wrote it, nor load into a block
        before vLLM's zeroing of fresh blocks ran."""
        if self.caches.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def order_compute(self, posted: Posted) -> bool:
        """Make the compute stream wait for ``posted`` on the device; False if some transfer
        needs the host to wait (then the caller must wait for it now), as on a device with no
        streams (CPU)."""
        if self.caches.device.type != "cuda":
            return False
        stream = torch.cuda.current_stream(self.caches.device)
        return all([transfer.order_stream(stream) for _, transfer in posted.transfers])

    # --- stream-ordered pools: planned once, posted from this thread -----------------------

    def post_by_pool(self, entries: ByPool, layers: tuple[Layer, ...], *, write: bool) -> Posted:
        """Plan and post ``layers`` of ``entries`` as one part (a save, or a load at once), over
        every pool: pool by pool as each is planned, so a pool's bytes move while the next one's
        gather plan is built. (A part per layer: ``prepare_parts``, ``post_through``.)"""
        posted = [Posted(Batch(layers, entries), write)]
        for copies in self._prepared(entries, [layers], write=write):  # every layer of a repeated one posted whole
            self._post_parts(copies, posted, range(1))
        return posted[0]

    def prepare_parts(self, entries: ByPool, parts: list[tuple[Layer, ...]], *, write: bool) -> PartPosts:
        """Plan every part (a layer each) of ``entries`` on every pool, posting none: the parts
        are posted in order by ``post_through``, layer k on every pool before layer k + 1, so
        the first layers land first."""
        return PartPosts({pool: prepared for copies in self._prepared(entries, parts, write=write)
                          for pool, prepared in copies.items()},
                         [Posted(Batch(layers, entries), write) for layers in parts])

    def post_through(self, posts: PartPosts, last: int) -> None:
        """Post ``posts``' parts up to ``last`` (every pool's; none twice, none after ``drop``);
        once the last part is posted the plan is let go, as ``post_by_pool`` lets it go."""
        end = min(last + 1, len(posts.posted))
        if end > posts.next:
            self._post_parts(posts.prepared, posts.posted, range(posts.next, end))
            self.count_bytes([out.batch for out in posts.posted[posts.next:end]],
                             "saved" if posts.posted[0].write else "loaded")
            posts.next = end
            if end == len(posts.posted):
                posts.prepared = {}

    def _prepared(self, entries: ByPool, parts: list[tuple[Layer, ...]], *, write: bool) -> Iterator[Prepared]:
        """The step's copies, one pool at a time (each planned once, part k being the layers
        ``parts[k]``); the ranges of every pool are computed together first."""
        every = tuple(layer for part in parts for layer in part)
        try:  # a load: one layer's ranges repeated where it can be (else every layer's)
            repeated = self._repeated(entries, parts, write=write)
            plans: Mapping[PoolKey, Ranges | RepeatedRanges] = repeated if repeated is not None else \
                self.caches.ranges(Batch(every, entries), by_entry=len(parts) == 1)
        except Exception:  # noqa: BLE001 -- every pool's copies fail, nothing reaches vLLM
            log.exception("ucm-ray: planning a step's %s failed", "saves" if write else "loads")
            yield {pool: None for pool in entries}
            return
        for pool, by_group in entries.items():
            ranges = plans.get(pool, EMPTY)
            ends = [] if isinstance(ranges, RepeatedRanges) else part_ends(self.caches, by_group, parts, ranges)
            yield {pool: self._pools.prepare(pool, ranges, ends, write=write)}

    def _repeated(self, entries: ByPool, parts: list[tuple[Layer, ...]], *,
                  write: bool) -> dict[PoolKey, RepeatedRanges] | None:
        """A load's copies as one layer's ranges repeated, a part per layer: one posted layer by
        layer, or one at once whose layer's ranges are many (``REPEAT_AT_ONCE_RANGES``; its
        parts are then posted as one transfer). None: every layer's ranges."""
        if len(parts) > 1:
            return self.caches.repeated_ranges(parts, entries)
        if write or len(parts[0]) < 2:
            return None
        repeated = self.caches.repeated_ranges([(layer,) for layer in parts[0]], entries)
        if repeated is None or min((len(r.template) for r in repeated.values()), default=0) < REPEAT_AT_ONCE_RANGES:
            return None
        return repeated

    def _post_parts(self, copies: Prepared, posted: list[Posted], parts: range) -> None:
        """Post ``parts`` of ``copies`` (every pool in it), part k into ``posted[k]``, in order of
        k. One pool's parts go in one call (its stream made current once, not once a layer)."""
        if len(copies) == 1 and len(posted) > 1:
            ((pool, prepared),) = copies.items()
            started = time.perf_counter()
            each, failed = self._pools.post_each(pool, prepared, parts, write=posted[0].write)
            seconds = (time.perf_counter() - started) / len(parts)
            for at, part in enumerate(parts):
                out = posted[part]
                out.transfers += [(pool, each[at])] if each else []
                out.failed_pools |= failed
                out.post_s += seconds
            return
        for part in parts:
            out = posted[part]
            started = time.perf_counter()
            transfers, failed = self._pools.post_part(copies, part if len(posted) > 1 else None, write=out.write)
            out.transfers += transfers
            out.failed_pools |= failed
            out.post_s += time.perf_counter() - started

    # --- the copy thread -----------------------------------------------------------------

    def move_later(self, deadline: float, batch: Batch, *, write: bool,
                   ready: torch.cuda.Event | None = None) -> Future[Posted]:
        """``move`` on the copy thread, behind what is queued there."""
        return self._thread.submit(self.move, deadline, batch, write, ready)

    def move_each_later(self, deadline: float, batches: list[Batch],
                        ready: torch.cuda.Event | None) -> list[Future[Posted]]:
        """Load ``batches`` in order in one copy-thread task, each batch's future set as soon as
        it is posted (a task per batch cost its hand-off per batch, and the link idled meanwhile)."""
        posted: list[Future[Posted]] = [Future() for _ in batches]
        self._thread.submit(self._move_each, deadline, batches, ready, posted)
        return posted

    def move(self, deadline: float, batch: Batch, write: bool, ready: torch.cuda.Event | None = None) -> Posted:
        """Copy-thread task: post one batch per pool and return without waiting for them to land,
        so the next batch is planned and posted while this one moves. Any exception fails the
        whole batch instead of reaching vLLM, and nothing starts once ``deadline`` passed (its
        loads were reported failed by then)."""
        started = time.perf_counter()
        try:
            # vLLM's KV caches are inference tensors; the copy thread is ours and starts on device 0.
            with torch.inference_mode(), self._on_device():
                if ready is not None:
                    ready.synchronize()
                if self.clock() >= deadline:
                    return Posted(batch, write, failed=True)
                started = time.perf_counter()
                transfers, failed_pools = self._pools.post(self.caches.ranges(batch), write=write)
                return Posted(batch, write, transfers, failed_pools, post_s=time.perf_counter() - started)
        except Exception:
            log.exception("ucm-ray: a %s batch failed on the copy thread", "save" if write else "load")
            return Posted(batch, write, failed=True, post_s=time.perf_counter() - started)

    def _move_each(self, deadline: float, batches: list[Batch], ready: torch.cuda.Event | None,
                   posted: list[Future[Posted]]) -> None:
        """Copy-thread task: load ``batches`` in order, setting each one's future once posted. A
        future given up on before its turn (the deadline) is cancelled: skipped."""
        for batch, future in zip(batches, posted):
            if future.set_running_or_notify_cancel():
                future.set_result(self.move(deadline, batch, False, ready))

    def _on_device(self) -> AbstractContextManager:
        device = self.caches.device
        return torch.cuda.device(device) if device.type == "cuda" else nullcontext()

    # --- waits ---------------------------------------------------------------------------

    def left(self, deadline: float) -> float:
        """What is left of ``deadline`` on the worker's clock (0.0 once it passed)."""
        return max(0.0, deadline - self.clock())

    def posted_by_deadline(self, future: Future[Posted], deadline: float) -> Posted | None:
        """A copy task's batch once posted, or None when ``deadline`` passed first (the task is
        cancelled unless it already runs; one not ``cancelled()`` may still land)."""
        try:
            return future.result(timeout=self.left(deadline))
        except FutureTimeout:
            if not future.cancel():  # running: whatever it posts is abandoned as it is posted
                future.add_done_callback(_abandon)
            log.error("ucm-ray: copies of step missed the %.1f s deadline; treated as failed", self._timeout_s)
            self._stats.add(deadline_misses=1)
            return None

    def load_by_deadline(self, future: Future[Posted], deadline: float) -> Posted | None:
        """``posted_by_deadline`` of a load's copy task: one given up on while it runs is kept
        with the late reads (what it posts may land in blocks vLLM reuses). A save's is not: it
        writes no KV block (its rows are reported uncertain instead), and the next step's fence
        waited for its post, then stopped the worker (``LateReadError``) for a slow save."""
        posted = self.posted_by_deadline(future, deadline)
        if posted is None and not future.cancelled():
            self.late_reads.append(future)
        return posted

    def wait(self, posted: Posted, deadline: float) -> Failures:
        """Wait on the host (until ``deadline``) for a posted batch to land: the pools that failed
        it (those it could not be posted to blamed)."""
        failures = Failures.of(posted.failed_pools)
        failures.update(self._pools.wait(posted.transfers, write=posted.write, timeout_s=self.left(deadline),
                                         clock=self.clock))
        if failures.pools:
            self._count_late(failures, posted.write)
        return failures

    def _count_late(self, failures: Failures, write: bool) -> None:
        """Keep a failed batch's late reads for ``fence_late_reads``; count them and the staging
        slabs quarantined since the last failure."""
        if failures.late and not write:
            self.late_reads.extend(failures.late)
            self._stats.add(late_reads=len(failures.late))
        staging = self._pools.staging
        if staging is not None and staging.quarantines > self._quarantines:
            self._stats.add(staging_quarantines=staging.quarantines - self._quarantines)
            self._quarantines = staging.quarantines

    def fence_late_reads(self) -> None:
        """Before a step's forward (and only where ``late_reads`` holds any: a step without a
        failed load pays nothing): wait until no failed read can land any more, at most
        ``transfer_timeout_s``, else ``LateReadError``. Their blocks were reported failed, and
        vLLM recomputes them (or gives them to another request) in a later step: a read landing
        after that would leave another key's bytes in them. Only a read in flight waits here (a
        staged one never: it lands in a quarantined slab, scattered nowhere); on RDMA a read
        needs no work of the shard's process, so one is late only while the network fails it."""
        deadline = time.monotonic() + self._timeout_s
        transfers: list[tuple[PoolKey, Transfer]] = []
        for late in self.late_reads:
            if not isinstance(late, Future):
                transfers.append(late)
                continue
            try:
                posted = late.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self._stop(_late_read_stop("a load's copy task, still posting its NIXL reads,", self._timeout_s))
            transfers += posted.transfers
        pool_of = {id(transfer): pool for pool, transfer in transfers}
        still = still_late([transfer for _, transfer in transfers], deadline)
        if still:
            self.late_reads[:] = [(pool_of[id(transfer)], transfer) for transfer in still]
            shards = ", ".join(sorted({pool_of[id(transfer)][0] for transfer in still}))
            self._stop(_late_read_stop(f"{len(still)} NIXL read(s) from shard {shards}", self._timeout_s))
        self.late_reads.clear()

    @staticmethod
    def _stop(error: LateReadError) -> NoReturn:
        """Log ``error`` as one line of ours, then raise it: vLLM's own report of a worker's
        exception is three tracebacks (worker, engine core, API server) with the reason inside."""
        log.error("%s", error)
        raise error

    # --- counters ------------------------------------------------------------------------

    def count_bytes(self, batches: list[Batch], what: str) -> None:
        """``loaded_copy_bytes`` and ``loaded_shm_bytes``, ``saved_nixl_bytes``, ...: how much,
        and which path the bytes took (a step's load batches counted together)."""
        by_pool: dict[PoolKey, int] = defaultdict(int)
        for batch in batches:
            for pool, nbytes in batch.nbytes_by_pool(self.caches.layouts).items():
                by_pool[pool] += nbytes
        self._count(by_pool, what)

    def count_entries(self, entries: ByPool, what: str) -> None:
        """``count_bytes`` of whole entries (every layer of their groups: a save job), an entry's
        bytes each, not a sum over its layers per pool."""
        layouts = self.caches.layouts
        self._count({pool: sum(len(held.block_ids) * layouts[group].entry_bytes for group, held in by_group.items())
                     for pool, by_group in entries.items()}, what)

    def _count(self, by_pool: Mapping[PoolKey, int], what: str) -> None:
        self._stats.add(**{f"{what}_copy_bytes": sum(by_pool.values())})
        for pool, nbytes in by_pool.items():
            self._stats.add(**{f"{what}_{self._pools.kind(pool)}_bytes": nbytes})
