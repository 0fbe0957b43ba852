"""``WorkerPart``: the connector's worker role, vLLM's worker hooks in order over the worker's parts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.compat import check_async_loads_reportable
from ucm_ray.vllm.metadata import UcmRayConnectorMetadata, UcmRayWorkerMetadata
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker.copies import Copier
from ucm_ray.vllm.worker.loads import StepLoads
from ucm_ray.vllm.worker.plan import KvCaches
from ucm_ray.vllm.worker.results import WorkerResults
from ucm_ray.vllm.worker.saves import SavesInFlight
from ucm_ray.vllm.worker.step import LoadPhase, StepState

log = logging.getLogger(__name__)


class WorkerPart:
    """``pools`` and ``indexes``: how this worker reaches the fleet's pools and reads their
    published indexes (by default those of ``node_id``; tests hand in doubles). ``clock``: the
    time of its step deadlines (``transfer_timeout_s``; a test may hand in one it moves)."""

    def __init__(self, kv_cache_config, config: UcmRayConfig, tp_rank: int, node_id: str | None = None, *,
                 pools: PoolConnections | None = None, indexes: IndexReaders | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_async_loads_reportable(len(kv_cache_config.kv_cache_groups))
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._rank = tp_rank
        self.stats = UcmRayStats()
        self._pools = PoolConnections(config.transport, node_id, nixl_staging=config.nixl_stage_through_host) \
            if pools is None else pools
        self._indexes = IndexReaders(node_id, remote=config.transport != "shm") if indexes is None else indexes
        self.results = WorkerResults(one_group=len(kv_cache_config.kv_cache_groups) == 1)
        """What this worker reports; the connector's result hooks test its ``empty``."""
        self._copies = Copier(self._pools, config.transfer_timeout_s, self.stats, clock=clock)
        self.late_reads = self._copies.late_reads
        """Failed reads that may still land in their KV blocks (``fence`` waits for them; the
        connector tests it on every step: a plain list, no call)."""
        self._loads = StepLoads(self._copies, self._indexes, self.results, self.stats, layerwise=config.layerwise)
        self._saves = SavesInFlight(self._copies, self.results, self.stats, checksums=config.checksum)
        self._idle_step = StepState()  # the state of every step without loads or state saves
        self._step = self._idle_step
        self._fenced: UcmRayConnectorMetadata | None = None  # the step whose fences are in place
        self.idle = True
        """Whether the step bound last left this worker nothing to do: no load or state save of
        its own and no save job in flight (only ``bind`` posts any), so this step's hooks have
        nothing to do, and those that take results (``load_errors``, ``transfer_results``,
        ``build_worker_meta``) nothing to check: what they would take is only what was gathered
        before (``results.empty`` says whether there is any). Set by ``bind``; False may be stale
        (jobs landed since), never True: the connector's hooks test it before any call
        (docs/performance-log.md, stops 66 and 67)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = KvCaches.build(kv_caches, self._kv_cache_config)
        self._copies.register(caches)
        log.info("ucm-ray worker rank %d: %s", self._rank,
                 ", ".join(f"group {layout.group}: {len(layout.layers)} layers x "
                           f"{layout.layers[0].block_bytes if layout.layers else 0} B/block"
                           for layout in caches.layouts))

    def open_pools(self, pools: Mapping[PoolKey, PoolDescriptor] | None) -> None:
        """Open the fleet's pools (mapped whole; on CUDA page-locked too) and their published
        indexes as the engine starts (``pools``: the directory's list; None where none
        answered): left to the first step's metadata, a fresh engine's first store hit paid for
        opening them. The first step's metadata still decides what stays open (a pool restarted
        meanwhile is closed and its new incarnation opened then)."""
        if not pools:
            return
        self._adopt_pools(pools)
        self._copies.open_pools()

    def _adopt_pools(self, pools: Mapping[PoolKey, PoolDescriptor]) -> None:
        """Make ``pools`` the current ones for copies and for validating unpinned loads (old
        incarnations' mappings are closed here, before any copy)."""
        self._copies.sync(pools)
        self._indexes.sync(pools)

    # --- per step ------------------------------------------------------------------------

    def bind(self, meta: UcmRayConnectorMetadata) -> bool:
        """The step's jobs (``meta``); whether this step's layer hooks have anything to do
        (``waits_by_layer``). A step whose metadata carries nothing for the workers, while no
        step's loads or save jobs are left here (most decode steps), does nothing else: no
        clock, no state, no call below."""
        if self.late_reads:
            self._copies.fence_late_reads()  # before anything of this step, and its forward, runs
        if not meta.work and self._step is self._idle_step and not self._saves.jobs:
            self.idle = True
            return False
        self.idle = False
        if self._step.phase is LoadPhase.POSTED:
            # No results were asked for since the last step posted them: its execution failed,
            # and its output with it. Land them (their blocks may be reused now); their block
            # ids are not vLLM's to redo in this step, so failures go to the scheduler only.
            log.warning("ucm-ray: a step's loads were never reported to vLLM (its execution failed?)")
            self._loads.finish_posted(self._step, to_vllm=False)
        self._saves.poll(step_end=False)
        if meta.pools is not None:
            self._saves.land_all()  # no copy may still use a mapping that closes now
            self._adopt_pools(meta.pools)
            self._copies.open_pools_later()  # ahead of this step's copies, on their thread
        # the scheduler learned that their saves landed: vLLM may free their blocks now
        self.results.saved_requests(meta.saved_requests)
        self.fence(meta)  # where vLLM did not call ``handle_preemptions`` first
        saves, states = meta.saves.get(self._rank), meta.state_saves.get(self._rank)
        loads, state_saves = meta.loads.get(self._rank), states if states is not None and len(states) else None
        if not (loads or state_saves is not None or saves is not None and len(saves)):
            self._step = self._idle_step
            self.idle = not self._saves.jobs
            return False
        deadline = self._copies.clock() + self._config.transfer_timeout_s
        # A step that loads nothing and saves no state (most decode steps) never writes into its
        # state: they share one, made once.
        self._step = StepState.bound(loads or [], deadline, state_saves) \
            if loads or state_saves is not None else self._idle_step
        if saves is not None and len(saves):
            self._saves.post(saves, deadline)
        return self.waits_by_layer

    @property
    def waits_by_layer(self) -> bool:
        """Whether this step's layer hooks have anything to do: some of its loads wait for their
        layer's hook (``BY_LAYER``), or they are bound and not posted yet (``PLANNED``: whether
        they go by layer is decided in ``start_load_kv``). Otherwise the connector leaves its
        metadata unbound, and vLLM calls neither layer hook (two calls a layer, every step)."""
        return self._step.phase is LoadPhase.BY_LAYER or self._step.phase is LoadPhase.PLANNED

    def fence(self, meta: UcmRayConnectorMetadata) -> None:
        """This step reuses blocks that these save jobs may still be reading (freed and
        allocated again, say to a preempted request's successor): whatever writes them must
        come after the copies. vLLM calls ``handle_preemptions`` (this) before it zeroes or
        copies into the step's new blocks, and before the forward and the step's loads."""
        if self.late_reads:
            self._copies.fence_late_reads()  # blocks a failed read may still land in are reused from here on
        if meta is self._fenced:
            return  # ``handle_preemptions`` did, before ``bind``
        self._fenced = meta
        if meta.fences:
            self._saves.fence(meta.fences)

    def start_load_kv(self) -> None:
        if self._step.phase is LoadPhase.PLANNED:
            self._loads.start(self._step)
        if self._saves.jobs:
            self._saves.loads_queued()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Only a step whose loads were posted layer by layer has any for a layer's hook (most
        steps load nothing: vLLM calls this for every layer of every step)."""
        if self._step.phase is LoadPhase.BY_LAYER:
            self._loads.wait_for_layer(self._step, layer_name)

    def wait_for_save(self) -> None:
        step = self._step
        if step is self._idle_step and not self._saves.jobs:
            return  # most decode steps: no load, no state, no save job
        self._saves.forward_queued()
        self._loads.finish_posted(step)
        self._loads.fail_unwaited(step)
        states = step.take_state_saves()
        if states is not None:
            self._saves.save_now(states, step.deadline)
        self._saves.poll(step_end=True)

    def build_worker_meta(self) -> UcmRayWorkerMetadata | None:
        if self._saves.jobs:
            self._saves.poll(step_end=True)
        return self.results.take_meta()

    def transfer_results(self) -> tuple[set[str], set[str], set[str]] | None:
        """(finished sending: their saves landed, finished receiving, of which failed); None
        when there are none."""
        if self._step is not self._idle_step:  # most steps: no load to check
            self._loads_over()
        if self._saves.jobs:
            self._saves.poll(step_end=True)
        return self.results.take_transfers()

    def load_errors(self) -> set[int]:
        if self._step is not self._idle_step:  # most steps: no load to check
            self._loads_over()
        return self.results.take_load_errors()

    def _loads_over(self) -> None:
        """vLLM asks for the step's results once its forward is queued, before ``wait_for_save``
        where it defers that past a draft model (a speculative config): the loads posted in
        ``start_load_kv`` are checked, and where no layer hook ran at all (a FULL CUDA graph
        replay) the layer loads are failed now, so their blocks reach vLLM in the step that
        loaded them (``to_vllm``). Once some hook ran, the layers still waiting are a draft
        model's, whose forward (and hooks) come after this call: ``wait_for_save`` settles them.
        (Called only for a step that is not the idle one: a quiet step's hooks make no call.)"""
        step = self._step
        if step.phase is LoadPhase.POSTED:
            self._loads.finish_posted(step)
        elif step.phase is LoadPhase.BY_LAYER and not step.hooked:
            self._loads.fail_unwaited(step)

    def shutdown(self) -> None:
        self._saves.land_all()
        self._copies.shutdown()
        self._indexes.close()
