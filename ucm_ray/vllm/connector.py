"""UcmRayConnector: the one class vLLM loads (``kv_connector_module_path: ucm_ray.vllm.connector``).

A thin adapter: the scheduler role delegates to ``SchedulerPart`` (which owns the
block lifecycle through a ``StoreClient``), the worker role to ``WorkerPart``
(which only moves bytes). Each process joins the Ray cluster first when vLLM
runs it outside Ray: the scheduler to reach the shards, the worker to know its
node (same-node pools are mapped, others reached over NIXL) and, once, the
pools to open as the engine starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import ray
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.engine.feed import MembershipFeed
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.compat import (
    PROM_METRICS_HOOK,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    check_model_runner,
    check_one_compute_stream,
)
from ucm_ray.vllm.metadata import UcmRayConnectorMetadata
from ucm_ray.vllm.scheduler import SchedulerPart
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker import WorkerPart
from ucm_ray.vllm.worker.results import NO_LOAD_ERRORS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def join_ray(config: UcmRayConfig) -> str:
    """Connect this process to the Ray cluster if vLLM started it outside Ray; its node id."""
    if not ray.is_initialized():
        ray.init(address=config.ray_address, namespace=config.ray_namespace, log_to_driver=False,
                 logging_level="WARNING")
    return ray.get_runtime_context().get_node_id()


def log_with_vllm() -> None:
    """Send ucm-ray's records to the handlers vLLM gave its own logger, at its level: vLLM sets up
    only the ``vllm`` logger, so an engine's log never showed our INFO lines (the recompute rule,
    each worker's layout). Left alone where the ``ucm_ray`` logger has handlers already (the
    operator configured it) or vLLM configured nothing (``VLLM_CONFIGURE_LOGGING=0``). Records
    still propagate to the root logger's handlers."""
    ours, theirs = logging.getLogger("ucm_ray"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError, ImportError):
        return 0


class _OtherRole:
    """What a connector holds for the half it does not run: any use is refused by name."""

    idle = False
    """What the worker hooks test before calling their part (``WorkerPart.idle``): False, so
    the call that follows is the one refused, by its name."""

    def __init__(self, half: str) -> None:
        self._half = half

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy's and pickle's lookups: this has none
            raise AttributeError(name)
        raise AssertionError(f"{self.__dict__.get('_half')}-side call ({name}) on a connector of the other role")


class UcmRayConnector(KVConnectorBase_V1, SupportsHMA):
    subclass_extra_keys: tuple[str, ...] = ()
    """Keys of the extra config that a subclass reads itself (the test harness hands its store
    so), left out of the ucm-ray settings."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_with_vllm()
        check_one_compute_stream(vllm_config.parallel_config)
        check_model_runner(vllm_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.ucm_config = UcmRayConfig.from_dict(extra, ignore=self.subclass_extra_keys)
        self._scheduler: SchedulerPart | None = None
        self._worker: WorkerPart | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerPart(vllm_config, kv_cache_config, self.ucm_config,
                                            self.open_store(self.ucm_config), clock=self.clock())
        else:
            node = self.node_id(self.ucm_config)
            self._worker = WorkerPart(kv_cache_config, self.ucm_config, _tp_rank(), node,
                                      pools=self.pool_connections(self.ucm_config, node),
                                      indexes=self.index_readers(self.ucm_config, node), clock=self.clock())
        # The hooks reach their half through plain attributes, not properties: every call a
        # quiet decode step makes costs it, with the host's caches cold, several times what it
        # costs in a loop (docs/performance-log.md, stop 65). The other role's is a stand-in
        # that refuses any use.
        self.scheduler_part: SchedulerPart = self._scheduler if self._scheduler is not None else \
            cast(SchedulerPart, _OtherRole("scheduler"))
        self.worker_part: WorkerPart = self._worker if self._worker is not None else \
            cast(WorkerPart, _OtherRole("worker"))
        self.late_reads: list = self._worker.late_reads if self._worker is not None else []
        """The worker's failed reads still in flight (``WorkerPart.late_reads``)."""
        part = self._scheduler if self._scheduler is not None else self._worker
        assert part is not None
        self._stats = part.stats  # one object for the part's life (``UcmRayStats.take`` empties it)

    def open_store(self, config: UcmRayConfig) -> BlockStore:
        """The scheduler's way to the shards (the test harness substitutes an in-process store)."""
        join_ray(config)
        return StoreClient(config)

    def clock(self) -> Callable[[], float]:
        """This role's clock: the scheduler's deadlines and timeouts, or the worker's step
        deadlines (the test harness substitutes one a test advances, one per role)."""
        return time.monotonic

    def node_id(self, config: UcmRayConfig) -> str:
        """The node this worker runs on: pools on it are mapped, others reached over NIXL."""
        return join_ray(config)

    def pool_connections(self, config: UcmRayConfig, node_id: str) -> PoolConnections:
        """The worker's transports to the fleet's pools (the test harness may substitute a double)."""
        return PoolConnections(config.transport, node_id, nixl_staging=config.nixl_stage_through_host)

    def index_readers(self, config: UcmRayConfig, node_id: str) -> IndexReaders:
        """The worker's readers of the pools' published indexes, which validate unpinned loads
        (the test harness may substitute readers of another node)."""
        return IndexReaders(node_id, remote=config.transport != "shm")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # --- scheduler role ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_part.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler_part.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_part.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_part.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_part.request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_part.request_finished(request)

    def get_kv_connector_stats(self) -> UcmRayStats | None:
        stats = self._stats
        return stats.take() if stats.data else None  # most steps: nothing since the last take, no call

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UcmRayStats:
        return UcmRayStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """The stats on vLLM's /metrics as ``vllm:ucm_ray_*`` (Ray's: ``ray_vllm_ucm_ray_*``)."""
        if not PROM_METRICS_HOOK:
            return None
        from ucm_ray.vllm.prom import UcmRayPromMetrics

        return UcmRayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_part.register_kv_caches(kv_caches)
        self.worker_part.open_pools(self.fleet_pools(self.ucm_config))

    def fleet_pools(self, config: UcmRayConfig) -> Mapping[PoolKey, PoolDescriptor] | None:
        """The fleet's pools as its directory lists them now (None where no directory answers:
        the engine started before its fleet); read once, as the engine starts."""
        membership = MembershipFeed(config.ray_namespace, config.lookup_timeout_s).fetch()
        return membership.descriptors if membership is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's jobs to the worker. vLLM calls the layer hooks (``wait_for_layer_load``,
        ``save_kv_layer``: two calls a layer) only while metadata is bound
        (``has_connector_metadata``), so it is bound only for a step whose layer hooks may have
        loads to wait for: most steps make none of those calls."""
        assert isinstance(connector_metadata, UcmRayConnectorMetadata)
        worker = self.worker_part
        # a quiet step after a quiet one (most decode steps): no call below (the base class's
        # ``bind_connector_metadata`` sets what this sets), as in every hook here that tests
        # ``idle``: with the host's caches cold, each call costs such a step (stop 66)
        if not connector_metadata.work and worker.idle and not self.late_reads:
            self._connector_metadata = None
            return
        self._connector_metadata = connector_metadata if worker.bind(connector_metadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM writes this step's new blocks (zeroing, copy-on-write, loads, the
        forward): wait for saves still reading any of them (``fences``), and for failed reads
        still in flight (``Copier.fence_late_reads``). A step without work for the workers
        (``QUIET_STEP``) fences nothing unless a read is late."""
        assert isinstance(kv_connector_metadata, UcmRayConnectorMetadata)
        if kv_connector_metadata.work or self.late_reads:
            self.worker_part.fence(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker = self.worker_part
        if worker.idle:
            return  # nothing bound (``bind_connector_metadata``), nothing to post
        worker.start_load_kv()
        if self._connector_metadata is not None and not worker.waits_by_layer:
            self.clear_connector_metadata()  # every load posted at once: no layer hook waits

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_part.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: blocks are saved whole from a later step's start, once the request's first
        token is out (``SchedulerPart``, ``WorkerPart``)."""

    def wait_for_save(self) -> None:
        worker = self.worker_part
        if not worker.idle:
            worker.wait_for_save()

    # The result hooks: a worker with nothing in flight (``idle``) and nothing gathered since the
    # last takes (``results.empty``) has nothing to report, and says so without a call (a quiet
    # decode step's three result hooks; docs/performance-log.md, stop 67). A result gathered
    # while the worker is idle (a finished send told by a step's metadata that posts nothing
    # else, a load's failure seen after one of the takes) leaves ``empty`` False until taken.

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self.worker_part
        if worker.idle and worker.results.empty:
            return None
        return worker.build_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self.worker_part
        if worker.idle and worker.results.empty:
            return None, None
        results = worker.transfer_results()
        if results is None:
            return None, None
        sending, done, _ = results
        return sending or None, done or None

    if KVConnectorTransferResults is not None:
        _NO_TRANSFERS = KVConnectorTransferResults()
        """The results of a step without any: one object, its sets never filled (vLLM reads
        them: the scheduler iterates them, the output aggregator unions them into its own)."""

        def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
            worker = self.worker_part
            if worker.idle and worker.results.empty:
                return self._NO_TRANSFERS
            results = worker.transfer_results()
            if results is None:
                return self._NO_TRANSFERS
            sending, done, failed = results
            return KVConnectorTransferResults(finished_sending=sending, finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.worker_part
        if worker.idle and worker.results.empty:
            return NO_LOAD_ERRORS
        return worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
