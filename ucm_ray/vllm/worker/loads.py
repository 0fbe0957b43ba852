"""A step's loads: posted in ``start_load_kv``, landed by layer or before the forward, checked, reported.

Layer L's bytes land while layers < L compute, and ``wait_for_layer_load`` makes layer L wait
for them: on stream-ordered pools the compute stream waits for the layer's event (the host
checks every copy once, at the end of the loads); on the copy thread's pools the host waits.
Stream-ordered layer loads are planned in ``start_load_kv`` and posted ``LAYERS_AHEAD`` layers
ahead of the hooks, so ``start_load_kv`` posts a few layers whatever the model's depth.
Loads that cannot wait for layer hooks are posted first and land before the forward pass;
asynchronous loads (their requests are not in the step) hold no forward back and land by the
time the step reports. A load counts only once it landed, its entry still holds what was
pinned or published (loads from unpinned entries are validated against the published index)
and its checksum matches.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import numpy as np
import torch

from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.types import NO_CHECKSUM
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker.copies import Copier, Posted
from ucm_ray.vllm.worker.plan import Batch, Layer, LoadPlan, Tag, group_tags, plan_loads
from ucm_ray.vllm.worker.results import WorkerResults
from ucm_ray.vllm.worker.step import StepState, ThreadedLoad

log = logging.getLogger(__name__)

LAYERS_AHEAD = 2
"""Stream-ordered layer loads: ``start_load_kv`` posts layers 0 .. ``LAYERS_AHEAD`` - 1, and layer
k's hook posts every layer up to k + ``LAYERS_AHEAD`` not posted yet (a skipped hook or another
order costs lead, never a layer) before the compute stream waits for layer k. A layer's copy is
then queued ``LAYERS_AHEAD`` launches before the layer that reads it, and while layer k computes
the pool's stream holds layers k + 1 .. k + ``LAYERS_AHEAD``: the copy engine idles only where
the host takes longer to launch one layer than the engine takes to copy ``LAYERS_AHEAD`` of them
(a large load's layer copies for far longer than a layer launches; a small one lands long before
its layer: performance log, stop 60). Where the host waits for each layer itself (checksums),
the layers queued behind it keep the engine busy meanwhile. Each layer more ahead is one more
post in ``start_load_kv``, whose host time this bounds; one fewer leaves a single layer queued
behind the one computing."""


class StepLoads:
    """Runs each step's loads (the step's state is ``StepState``; this holds none)."""

    def __init__(self, copies: Copier, indexes: IndexReaders, results: WorkerResults, stats: UcmRayStats, *,
                 layerwise: bool) -> None:
        self._copies = copies
        self._indexes = indexes  # validates loads copied from unpinned entries
        self._results = results
        self._stats = stats
        self._layerwise = layerwise

    # --- start_load_kv -------------------------------------------------------------------

    def start(self, step: StepState) -> None:
        """Post every load of the step: the ones that cannot wait for layer hooks first (the
        layer loads would delay them), waited for once the layer loads are posted too."""
        copies = self._copies
        plan = plan_loads(step.loads, copies.caches, layerwise=self._layerwise, stream_ordered=copies.stream_ordered)
        step.adopt(plan)
        # e.g. vLLM zeroing fresh blocks, queued before us (stream-ordered posts queue behind it)
        ready = copies.compute_ready() if plan.at_once_threaded or plan.by_layer_threaded else None
        first = copies.post_by_pool(plan.at_once, plan.every_layer, write=False) if plan.at_once else None
        first_threaded = self._at_once_threaded(step, plan, ready)
        self._post_by_layer(step, plan, ready)
        if first is not None and all(job.is_async for job in step.loads):
            step.unlanded.append(first)  # no forward of this step reads them: landed as the step reports
        elif first is not None:  # the forward waits for them from its first kernel
            self._order_or_land(step, first)
        if first_threaded is not None:
            self._wait(step, *first_threaded)
        copies.count_bytes(plan.batches(), "loaded")
        step.loads_started()

    def _at_once_threaded(self, step: StepState, plan: LoadPlan,
                          ready: torch.cuda.Event | None) -> ThreadedLoad | None:
        if not plan.at_once_threaded:
            return None
        batch = Batch(plan.every_layer, plan.at_once_threaded)
        return self._copies.move_later(step.deadline, batch, write=False, ready=ready), batch.tags()

    def _post_by_layer(self, step: StepState, plan: LoadPlan, ready: torch.cuda.Event | None) -> None:
        """Stream-ordered pools: every layer planned now and the first ``LAYERS_AHEAD`` posted,
        from this thread, the compute stream waiting per layer. The copy thread: layer after
        layer, each waited for at its hook."""
        copies = self._copies
        if plan.by_layer:
            parts: list[tuple[Layer, ...]] = [((group, index),) for group, index, _ in plan.layers]
            step.ordered = copies.prepare_parts(plan.by_layer, parts, write=False)
            step.ordered_layers = {name: part for part, (_, _, name) in enumerate(plan.layers)}
            copies.post_through(step.ordered, LAYERS_AHEAD - 1)
        threaded = plan.by_layer_threaded
        tags = {group: group_tags(threaded, group) for by_group in threaded.values() for group in by_group}
        per_layer = [(name, Batch(((group, index),), threaded), tags[group])
                     for group, index, name in plan.layers if group in tags]
        if per_layer and copies.caches.device.type == "cuda":  # NIXL: a post only queues the transfer
            posted = copies.move_each_later(step.deadline, [batch for _, batch, _ in per_layer], ready)
            step.threaded_layers = {name: (future, layer_tags)
                                    for (name, _, layer_tags), future in zip(per_layer, posted)}
        elif per_layer:  # a post is the copy itself: one task per layer, each waited for as it lands
            step.threaded_layers = {name: (copies.move_later(step.deadline, batch, write=False, ready=ready),
                                           layer_tags)
                                    for name, batch, layer_tags in per_layer}

    # --- layer hooks ---------------------------------------------------------------------

    def wait_for_layer(self, step: StepState, name: str) -> None:
        """Layer ``name``'s loads land before it computes; its stream-ordered part first posts
        the layers up to ``LAYERS_AHEAD`` after it (and itself, if no hook before posted it)."""
        threaded, part = step.take_layer(name)
        posted = None
        if part is not None:
            assert step.ordered is not None
            self._copies.post_through(step.ordered, part + LAYERS_AHEAD)
            posted = step.ordered.posted[part]
        if threaded is not None:
            self._wait(step, *threaded)
        if posted is not None:
            self._order_or_land(step, posted)
        if (threaded is not None or posted is not None) and not step.layers_pending:
            self._finish(step)

    def finish_posted(self, step: StepState, *, to_vllm: bool = True) -> None:
        """Check and report loads that were all posted in ``start_load_kv``, if not done yet."""
        if step.take_posted():
            self._finish(step, to_vllm=to_vllm)

    def fail_unwaited(self, step: StepState) -> None:
        """Layer loads whose hook never ran: the forward pass did not wait for their bytes (a
        FULL CUDA graph replay runs no Python). Its output cannot be trusted, so the loads are
        failed and vLLM drops this step's tokens and recomputes: wrong tokens stay impossible
        even if the hit policy let such a step through."""
        if not step.layers_pending:
            return
        unwaited = step.unwaited_layers()
        log.warning("ucm-ray: %d layer load(s) were never waited for by the forward pass; "
                    "failing them so vLLM recomputes", len(unwaited))
        self._stats.add(unwaited_layer_loads=len(unwaited))
        threaded, ordered, unposted = step.take_unwaited()
        for future, tags in threaded:
            self._wait(step, future, tags)  # the copies must be over before the blocks are reused
            step.failed |= tags
        for posted in ordered:
            self._land(step, posted)
            step.failed |= posted.batch.tags()
        for never in unposted:  # no copy of theirs was queued: nothing to land
            step.failed |= never.batch.tags()
        self._finish(step)

    # --- waits ---------------------------------------------------------------------------

    def _order_or_land(self, step: StepState, posted: Posted) -> None:
        """The compute stream waits for ``posted`` on the device, or (checksums read each
        layer's blocks as they land; or a transfer needs the host) the host waits now."""
        if step.sums or not self._copies.order_compute(posted):
            self._land(step, posted)
        else:
            step.unlanded.append(posted)

    def _wait(self, step: StepState, future: Future[Posted], tags: set[Tag]) -> None:
        """Wait for a copy task's batch to be posted, then to land, within what is left of the
        step's deadline."""
        started = time.perf_counter()
        posted = self._copies.load_by_deadline(future, step.deadline)
        if posted is None:
            step.failed |= tags
            return
        self._land(step, posted, started)

    def _land(self, step: StepState, posted: Posted, since: float | None = None) -> None:
        """Wait on the host for a posted batch to land and take its failures (``since``: when
        the wait began, if it began before its post was in)."""
        started = time.perf_counter() if since is None else since
        failures = self._copies.wait(posted, step.deadline)
        seconds = posted.post_s + time.perf_counter() - started
        self._results.pools_failed(failures.blamed)
        step.landed(posted, failures.pools, seconds, self._copies.caches.layouts)

    # --- checks and results --------------------------------------------------------------

    def _finish(self, step: StepState, *, to_vllm: bool = True) -> None:
        """All copies of the step are in: validate unpinned ones, verify checksums and report
        what vLLM must redo (``to_vllm``: the failed blocks of synchronous loads go to vLLM,
        which it may only be told in the step that loaded them)."""
        for posted in step.take_unlanded():
            self._land(step, posted)
        self._validate_unpinned(step)
        self._verify_checksums(step)
        loads = step.loads_finished()
        for job in loads:
            bad = step.bad_blocks(job)
            self._results.load_done(job, bad, to_vllm=to_vllm)
            self._stats.add(loaded_blocks=len(job.blocks) - len(bad), load_failures=len(bad))
        if loads:
            self._stats.observe("load_seconds", step.load_s)

    def _validate_unpinned(self, step: StepState) -> None:
        """Loads copied from entries nobody pinned (found in a published index) count only if the
        entry is still listed as it was: otherwise its slot may have been reused mid-copy."""
        for job in step.loads:
            tags, locations = step.tags[job.job_id], job.blocks.locations
            rows = np.flatnonzero(locations.generation)
            if step.failed:
                rows = rows[[tags[row] not in step.failed for row in rows.tolist()]]
            if not len(rows):
                continue
            stale, unreadable = self._indexes.stale(locations, job.blocks.keys, rows)
            self._results.pools_unvalidated(unreadable)
            step.failed.update(tags[row] for row in rows[stale].tolist())
            self._stats.add(stale_loads=int(stale.sum()))

    def _verify_checksums(self, step: StepState) -> None:
        """A block whose bytes do not match its entry's checksum failed (and the entry is reported)."""
        for job in step.loads:
            tags, locations = step.tags[job.job_id], job.blocks.locations
            for row in np.flatnonzero(locations.checksum != NO_CHECKSUM).tolist():
                running = step.sums.get(tags[row])
                if tags[row] not in step.failed and (running is None or running.value() != locations.checksum[row]):
                    location = locations[row]
                    assert location is not None
                    log.error("ucm-ray: checksum mismatch for block %d of %s (shard %s): recomputed",
                              tags[row][1], job.req_id, location.shard_id)
                    self._stats.add(checksum_mismatches=1)
                    step.failed.add(tags[row])
                    self._results.corrupt(location)
