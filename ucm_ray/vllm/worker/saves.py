"""Save jobs in flight: posted late, looked at without waiting, fenced, landed and reported.

Saves are taken late: a job holds, every layer at once, attention blocks that earlier steps
filled (their KV is written, and nothing writes them while their request runs). The copy
thread's pools get it after the step's loads; stream-ordered pools once the step's forward is
queued, so the host plans their copies while the device computes and the copies queue behind
the compute stream's work, on their own stream. Jobs on stream-ordered pools outlive their
step: at each hook the host looks, without waiting, for jobs that landed (or missed their
deadline). The copy thread's saves are waited for at the end of their step, and only they: a
job with parts on both kinds of pool (a multi-node fleet's) lands once its stream-ordered part
has too. The scheduler plans a request's saves once its first token is out, so neither the
copies nor the host work of saving delay a cold request's first token. Blocks stay put
while a save reads them: a step that reuses a block a save may still read names that job in
its ``fences``, and whatever writes the block waits for the job first. Mamba states are saved
after the forward that computes them and waited for at once: the next step overwrites them.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from ucm_ray.store.checksum import Checksum
from ucm_ray.store.types import NO_CHECKSUM
from ucm_ray.transport.base import PoolKey
from ucm_ray.transport.pools import Failures
from ucm_ray.vllm.metadata import BlockSaves, SaveResult
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker.copies import Copier, Posted
from ucm_ray.vllm.worker.plan import Batch, ByPool, Layer, save_entries
from ucm_ray.vllm.worker.results import WorkerResults


@dataclass(eq=False)
class SaveJob:
    """A save job: batches on stream-ordered pools (posted once the step's forward is queued:
    ``ordered``), and the copy thread's part (handed to it after the step's loads, which must
    not queue behind it: ``threaded``). It lands when it lands, and counts as failed once
    ``deadline`` passed."""

    saves: BlockSaves
    layers: tuple[Layer, ...]
    deadline: float
    ordered: ByPool
    """Entries on stream-ordered pools not posted yet. Planning them is host time: before the
    forward's launch it held the device back, after it the host plans while the device
    computes. The blocks were written by earlier steps and no step writes them while their
    request runs, so the copies may follow the forward."""
    threaded: ByPool
    """Entries on the copy thread's pools not handed to it yet."""
    posted: list[Posted] = field(default_factory=list)
    futures: list[Future[Posted]] = field(default_factory=list)
    posted_at: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        """Whether every copy of the job is over (never waits)."""
        if self.threaded or self.ordered or not all(future.done() for future in self.futures):
            return False
        batches = self.posted + [future.result() for future in self.futures if not future.cancelled()]
        try:
            return all(transfer.done() for batch in batches for _, transfer in batch.transfers)
        except Exception:  # noqa: BLE001 -- a failed transfer is over; landing the job takes its error
            return True


class SavesInFlight:
    """Save jobs posted, not yet seen landed (oldest first)."""

    def __init__(self, copies: Copier, results: WorkerResults, stats: UcmRayStats, *, checksums: bool) -> None:
        self._copies = copies
        self._results = results
        self._stats = stats
        self._checksums = checksums
        self.jobs: list[SaveJob] = []
        """Posted, not yet seen landed (most decode steps: none). A list the worker's hooks test
        as it is, not a property: each call a quiet step makes costs it, with the host's caches
        cold, several times what it costs in a loop (docs/performance-log.md, stop 65)."""

    def post(self, saves: BlockSaves, deadline: float) -> None:
        """A step's save job (``bind``): its stream-ordered part waits for ``forward_queued``."""
        self.jobs.append(self._job(saves, deadline, ordered_later=True))

    def save_now(self, saves: BlockSaves, deadline: float) -> None:
        """Save and wait for it (mamba states, which the next step overwrites)."""
        self._land(self._job(saves, deadline))

    def loads_queued(self) -> None:
        """The step's loads are queued: the copy thread may take the saves' part now."""
        for job in self.jobs:
            self._hand_to_copier(job)

    def forward_queued(self) -> None:
        """The forward is queued: the host plans the stream-ordered part while it runs."""
        for job in self.jobs:
            self._post_ordered(job)

    def poll(self, *, step_end: bool) -> None:
        """Take the results of the jobs that landed (or missed their deadline) since the last
        look, without waiting for those on stream-ordered pools: the engine's steps go on while
        they move. At the end of a step (``step_end``) the host waits for the copy thread's
        part of its jobs: that thread needs the GIL between its copies, which an engine thread
        running Python hands over only every switch interval, so saves took many steps to land;
        waiting, the host lets it run. In paranoid mode (``checksum``) every job lands before
        its step ends: its checksum is taken from vLLM's blocks, which must still hold what was
        saved."""
        if not self.jobs:
            return  # most decode steps
        for job in self.jobs:  # a step without ``start_load_kv`` (one that runs no tokens)
            self._hand_to_copier(job)
            self._post_ordered(job)  # this step's forward is queued (or, at ``bind``, the last one's)
        if step_end and not self._checksums:
            for job in self.jobs:
                self._wait_threaded(job)
        now = self._copies.clock()
        landing = [job for job in self.jobs
                   if (step_end and self._checksums) or now >= job.deadline or job.done()]
        for job in landing:
            self._land(job)
        if landing:
            self.jobs = [job for job in self.jobs if job not in landing]

    def fence(self, job_ids: Collection[int]) -> None:
        """Whatever writes the blocks these jobs may still read comes after their copies: the
        current stream waits for stream-ordered copies on the device, the host for the copy
        thread's."""
        fenced = [job for job in self.jobs if job.saves.job_id in job_ids]
        if not fenced:
            return
        self._stats.add(save_fences=len(fenced))
        for job in fenced:
            self._post_ordered(job)
        host = [job for job in fenced
                if job.futures or job.threaded or not all([self._copies.order_compute(p) for p in job.posted])]
        for job in host:
            self._land(job)
        self.jobs = [job for job in self.jobs if job not in host]

    def land_all(self) -> None:
        """Wait for every job still copying (the pools' mappings are about to change)."""
        for job in self.jobs:
            self._land(job)
        self.jobs = []

    # --- helpers -------------------------------------------------------------------------

    def _job(self, saves: BlockSaves, deadline: float, *, ordered_later: bool = False) -> SaveJob:
        """A save job, every layer of its blocks at once: one batch per pool, queued behind the
        compute stream's work so far (which wrote the blocks); ``ordered_later``: its
        stream-ordered pools' batches wait for ``_post_ordered`` (after the step's forward)."""
        entries = save_entries(saves)
        layers = self._copies.caches.saved_layers(entries)
        ordered, threaded = self._copies.split(entries)
        job = SaveJob(saves, layers, deadline, ordered, threaded)
        if not ordered_later:
            self._post_ordered(job)
        self._copies.count_entries(entries, "saved")
        return job

    def _post_ordered(self, job: SaveJob) -> None:
        """Post a job's batches on stream-ordered pools, if not yet posted."""
        if job.ordered:
            ordered, job.ordered = job.ordered, {}
            job.posted.append(self._copies.post_by_pool(ordered, job.layers, write=True))

    def _hand_to_copier(self, job: SaveJob) -> None:
        """The copy thread's part of a job, once the step's loads are queued there."""
        if job.threaded:
            batch = Batch(job.layers, job.threaded)
            job.futures.append(self._copies.move_later(job.deadline, batch, write=True,
                                                       ready=self._copies.compute_ready()))
            job.threaded = {}

    def _wait_threaded(self, job: SaveJob) -> None:
        """Wait (within the job's deadline) for the copy thread's part of a job, posts and
        transfers, and not for its stream-ordered part: that part is queued after the step's
        forward, so waiting for it would hold the host for the whole forward. A failure or a
        missed deadline is taken when the job lands (a transfer's ``wait`` may be called again)."""
        for future in job.futures:
            try:
                posted = future.result(timeout=self._copies.left(job.deadline))
            except FutureTimeout:
                return  # past its deadline: it lands (failed) in this poll
            for _, transfer in posted.transfers:
                with suppress(Exception):
                    transfer.wait(self._copies.left(job.deadline))

    def _land(self, job: SaveJob) -> None:
        """Wait (within the job's deadline) for a job's copies; its result per row."""
        self._hand_to_copier(job)
        self._post_ordered(job)
        posted, failed, uncertain = list(job.posted), False, False
        for future in job.futures:
            batch = self._copies.posted_by_deadline(future, job.deadline)
            if batch is None:
                failed = True
                uncertain = uncertain or not future.cancelled()  # running: it may still land later
            else:
                posted.append(batch)
        failures = Failures()
        for batch in posted:
            failed = failed or batch.failed
            failures.update(self._copies.wait(batch, job.deadline))
        self._results.pools_failed(failures.blamed)
        self._report(job, failed, failures.pools, uncertain or bool(failures.late))

    def _report(self, job: SaveJob, failed: bool, failed_pools: set[PoolKey], uncertain: bool) -> None:
        saves, locations = job.saves, job.saves.locations
        pool_failed = np.asarray([pool in failed_pools for pool in locations.pools] + [True], dtype=bool)
        landed = np.zeros(len(saves), dtype=bool) if failed else ~pool_failed[locations.pool]
        sums = self._entry_checksums(saves, landed) if self._checksums and landed.any() else None
        self._results.save_done(saves.job_id, SaveResult(landed, sums, uncertain=uncertain))
        self._stats.add(save_failures=int((~landed).sum()))
        self._stats.observe("save_seconds", time.perf_counter() - job.posted_at)

    def _entry_checksums(self, saves: BlockSaves, landed: np.ndarray) -> np.ndarray:
        """Per row, the checksum of the entry as its bytes lie in the pool (layers in order, segments
        in order), taken once per block (its replicas share it); NO_CHECKSUM where not landed."""
        layouts = self._copies.caches.layouts
        out: np.ndarray = np.full(len(saves), NO_CHECKSUM, dtype=np.int64)
        done: dict[tuple[int, int], int] = {}
        for row in np.flatnonzero(landed).tolist():
            block = (int(saves.groups[row]), int(saves.block_ids[row]))
            if block not in done:
                running = Checksum()
                for layer in layouts[block[0]].layers:
                    for segment in layer.segments(block[1]):
                        running.update(segment)
                done[block] = running.value()
            out[row] = done[block]
        return out
