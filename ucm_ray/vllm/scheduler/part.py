"""SchedulerPart: vLLM's scheduler-side connector hooks, each running the parts in order.

The parts: ``lookup`` (a request's hit, pinned), ``loads`` (load jobs and fences), ``saves``
and ``save_jobs`` (what each step saves into slots announced ahead), ``results`` (what the
workers and the store answered), over one record per request (``request``: its phase) and
the engine's cache ``geometry``. ``timing`` counts the hooks' host time.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import Publishes
from ucm_ray.vllm.metadata import QUIET_STEP, UcmRayConnectorMetadata, UcmRayWorkerMetadata
from ucm_ray.vllm.scheduler.answers import StoreAnswers
from ucm_ray.vllm.scheduler.geometry import CacheGeometry
from ucm_ray.vllm.scheduler.handoff import Handoffs
from ucm_ray.vllm.scheduler.loads import LoadPlanner
from ucm_ray.vllm.scheduler.lookup import Lookups
from ucm_ray.vllm.scheduler.prefill_rate import PrefillRate
from ucm_ray.vllm.scheduler.request import Phase, TrackedRequests
from ucm_ray.vllm.scheduler.results import Results
from ucm_ray.vllm.scheduler.save_jobs import SaveJobs
from ucm_ray.vllm.scheduler.saves import SavePlanner
from ucm_ray.vllm.scheduler.timing import HostTimer, host_timed
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__package__)


class SchedulerPart:
    """The scheduler half of the connector: owner of the block lifecycle."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: UcmRayConfig,
                 store: BlockStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time of every deadline and timeout here and in the slot supply (a test
        advances its own instead of sleeping)."""
        self.geometry = CacheGeometry.of(vllm_config, kv_cache_config, config)
        self._store = store
        self._clock = clock
        self.stats = UcmRayStats()
        self.timer = HostTimer(self.stats)
        self.slots = SlotSupply(store, max_free=vllm_config.scheduler_config.max_num_seqs,
                                renew_after_s=config.reserve_timeout_s / 3, idle_s=config.reserve_timeout_s / 3,
                                usable_s=config.reserve_timeout_s - config.transfer_timeout_s, clock=clock)
        self.slots.want(*self.geometry.entry_bytes)
        self._requests = TrackedRequests(self.geometry, self.stats)
        self._answers = StoreAnswers(store, self.stats)
        job_ids = itertools.count(1)  # load and save jobs share one sequence
        save_jobs = SaveJobs(store, self.slots, self.geometry.entry_bytes, self._requests, job_ids, clock)
        self.saves = SavePlanner(self.geometry, store, self.slots, self._requests, save_jobs, self.stats, clock)
        self.handoffs = Handoffs(self.geometry, config, self.stats)
        self.prefill_rate = PrefillRate(self.geometry.kv_bytes_per_token)
        self.lookups = Lookups(self.geometry, config, store, self.slots, self._requests, self.saves, self._answers,
                               self.handoffs, self.stats, clock, self.prefill_rate)
        self.loads = LoadPlanner(self.geometry, config, self._requests, save_jobs, job_ids, clock)
        self.results = Results(self.geometry, config, store, self._requests, self.lookups, self.loads, self.saves,
                               self._answers, self.slots, self.stats, clock)
        self._pools_sent: int | None = None
        self._next_meta = UcmRayConnectorMetadata()
        """What the next step is planned into (handed out only if it gets work)."""
        geometry = self.geometry
        log.info("ucm-ray scheduler: groups attn=%s state=%s block sizes=%s lcm=%d hash=%d recompute=%d",
                 geometry.attn, geometry.states, geometry.block_sizes, geometry.lcm, geometry.hash_block_size,
                 geometry.recompute)
        max_len = vllm_config.model_config.max_model_len
        if geometry.hybrid and geometry.lcm >= max_len:
            log.warning("ucm-ray: this hybrid model's LCM block is %d tokens, not shorter than max_model_len "
                        "(%d): no prompt fills one, so nothing is stored or loaded here (vLLM sizes state "
                        "blocks so without prefix caching and mamba_cache_mode='align')", geometry.lcm, max_len)

    @property
    def namespaces(self) -> list[bytes]:
        """Per tp rank, the namespace digest mixed into this engine's keys."""
        return list(self.geometry.namespaces)

    @property
    def hybrid(self) -> bool:
        return self.geometry.hybrid

    def phase_of(self, req_id: str) -> Phase | None:
        """The phase of a request this half tracks (None: not asked about yet, or forgotten)."""
        tracked = self._requests.get(req_id)
        return None if tracked is None else tracked.phase

    @property
    def recompute(self) -> int:
        """Prompt tokens vLLM computes itself after a dense hit (a test may force another rule)."""
        return self.geometry.recompute

    @recompute.setter
    def recompute(self, tokens: int) -> None:
        self.geometry.recompute = tokens

    # --- vLLM's hooks ----------------------------------------------------------------------

    @host_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched = self.lookups.matched(request, num_computed_tokens)
        if matched[0] is None:  # asked again next step: the request waits on the store
            self.timer.request_waits = True
        return matched

    @host_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        lookup = tracked.lookup
        if lookup is None or not lookup.answered:
            tracked.allocated()  # no lookup, or the second call of an async load
            self.saves.skip(tracked, tracked.local_tokens)
            return
        if num_external_tokens <= 0:
            self.lookups.release(tracked)
            tracked.allocated()
            self.saves.skip(tracked, tracked.local_tokens)
            return
        start = tracked.local_tokens
        end = start + num_external_tokens
        loads = self.loads.plan(tracked, lookup, blocks.get_block_ids(), start, end)
        tracked.start_loading(num_external_tokens)  # the pins now belong to the load jobs
        self.saves.skip(tracked, end)
        if self.hybrid and tracked.hit_tokens > tracked.last_state_pos:  # its hit ends on a stored state
            tracked.last_state_pos = tracked.hit_tokens
            tracked.state_positions.append(tracked.hit_tokens)
        self.stats.add(load_blocks=len(loads[0].blocks))
        from_disk = self.loads.in_flight[loads[0].job_id].from_disk
        if from_disk:
            self.stats.add(disk_hit_blocks=from_disk)

    def build_connector_meta(self, out: SchedulerOutput) -> UcmRayConnectorMetadata:
        """The step's plan: the store's answers and the pools first, then the block ids the
        output hands out, the loads and their fences, the saves (one slot ask per pool and size
        for the step's expected saves), and the finished requests whose blocks vLLM may free.
        Planned into a metadata object that is handed out only when the step has work for the
        workers; a step without (most decode steps) gets ``QUIET_STEP`` and makes none.

        A quiet step (nothing new since the last plan, the same pools, no request whose last
        plan moved) ends after the slot tick and the requests' pass: every part it skips would
        find nothing, and with the host's caches cold each cost it a few microseconds
        (docs/performance-log.md, stop 66)."""
        started = self.timer.clock()
        # Nothing before the slot tick and the requests' pass: no store answer or worker result
        # awaited, no request finished, loading, new, resumed or given a block, no hook time for
        # the timer to record (a quiet step's own is recorded nowhere), and tokens run (a step
        # without adds its time to the idle time); a hybrid plans its states every step. Read
        # here, attributes only: each call costs a quiet step with the host's caches cold.
        timer, cached = self.timer, out.scheduled_cached_reqs
        quiet = not (timer.host_s or timer.idle_s or timer.request_waits or out.total_num_scheduled_tokens <= 0
                     or self.geometry.hybrid or out.scheduled_new_reqs or self.saves.finished
                     or self.saves.jobs.in_flight or self.loads.in_flight or self.loads.to_dispatch
                     or self._requests.finishing or not self._answers.idle
                     or cached.resumed_req_ids or any(cached.new_block_ids))
        if not quiet:
            self.results.collect()
            if self.saves.finished:  # requests ended since the last plan (most steps: none)
                self.saves.announce_finished()  # before the tick that asks for their slots
        meta = self._next_meta
        # the slot supply's tick, and the fleet's pools to the workers when they changed
        pools = self._store.pools()
        now = self._clock()
        self.slots.tick(pools, now)  # (whatever it does, it puts nothing into the step's metadata)
        if pools.version != self._pools_sent:
            quiet = False
            meta.pools = dict(pools.descriptors)
            self._pools_sent = pools.version
            self.lookups.keep_pools(set(pools.descriptors))
        if quiet:  # no block ids to take, no load to dispatch, no save to fence
            to_plan = self._requests.to_plan()  # the requests whose last plan does not stand
            if not to_plan:
                self.prefill_rate.planned(out.total_num_scheduled_tokens, now)
                return QUIET_STEP  # nothing for the timer to record: no hook's time since the last plan
        else:
            self._requests.take_block_ids(out)
            self.loads.dispatch(out, meta)
            if self.saves.jobs.in_flight:  # none: nothing to fence
                meta.fences = self.loads.fences(out, meta.loads)
            to_plan = self._requests.to_plan()  # after those, which may move a request's plan
        self.saves.plan_step(out, meta, to_plan)  # its slot asks batched, one per class
        now = self._clock()  # one reading for the holds and the prefill rate (a test's clock is a call)
        released = self._requests.release_held(now)
        if released:
            meta.saved_requests.update(released)
        work = meta.carries_work()
        self.timer.observe_step(out.total_num_scheduled_tokens, work, self.timer.clock() - started)
        self.prefill_rate.planned(out.total_num_scheduled_tokens, now)
        if not work:
            return QUIET_STEP  # ``_next_meta`` is still empty: the next step plans into it
        self._next_meta = UcmRayConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.prefill_rate.answered(self._clock)
        results = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(results, UcmRayWorkerMetadata):  # None: a step whose workers had nothing to say
            self._take_results(results)

    @host_timed
    def _take_results(self, results: UcmRayWorkerMetadata) -> None:
        self.results.take(results)

    @host_timed
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of the request still to be saved (those its last step filled, and generated
        blocks short of a DECODE_SAVE_TOKENS batch) keep it: vLLM holds its blocks until the next
        step saved them and reported it ``finished_sending``. Otherwise (or with no pool to save
        into) they are freed at once. A PD prefill's params tell its decode what to wait for
        (``handoff``)."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return False, None
        params = self.handoffs.prefill_params(tracked)
        self.lookups.release(tracked)
        if tracked.block_ids and tracked.unsaved() and self._store.pools().descriptors:
            self._requests.finish(tracked, self._clock())
            if tracked.prompt_expected:  # generated blocks of an unfinished batch: slots at the next step's tick
                self.saves.expect_finished(tracked)
            return True, params
        self._requests.drop(request.request_id)
        return False, params

    # --- tools, tests and shutdown ---------------------------------------------------------

    def flush(self, timeout_s: float) -> None:
        """Wait until the store answered every commit, release and removal posted so far (tools
        and tests that hand a prefix to another engine right away; the engine never waits)."""
        deadline = self._clock() + timeout_s
        while self._answers.waiting and self._clock() < deadline:
            time.sleep(0.001)
            self.results.collect()

    def settled(self) -> bool:
        """No job waits for a worker's result and no control call for the store's answer."""
        return not (self.loads.in_flight or self.saves.jobs.in_flight or not self._answers.idle
                    or self._requests.any_finishing())

    def shutdown(self) -> None:
        """Hand unused slots back (best effort: a lapsed grant frees them anyway)."""
        unused = self.slots.close()
        if unused:
            self._store.commit(Publishes.of([]), unused).result()
        self._store.close()

    def take_stats(self) -> UcmRayStats | None:
        return self.stats.take()
