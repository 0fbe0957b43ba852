"""Both halves of the connector in one process, driven by vLLM's real Scheduler, without a model.

The scheduler half runs inside vLLM's own ``Scheduler`` (hashing, allocation,
chunking, preemption: all vLLM's). The worker half is our real ``WorkerPart``
on KV-cache tensors shaped as vLLM's CPU backend shapes them, and a stand-in
forward pass that writes, into each block a step computes, a value derived
from the block's hash and the layer. A block that the connector *loaded*
must therefore hold exactly what computing it would have written: the
harness checks every loaded block, layer by layer, right before the
"forward" touches that layer, and counts as ``wrong_blocks`` any that differ
without having been reported to vLLM as a failed load. That is the promise
("never a wrong byte") as a number a test can assert.

The store is any ``BlockStore``: the in-process ``LocalBlockStore`` (fast,
and it plays faults) or a Ray ``StoreClient``. Each engine's scheduler half runs on a clock
of its own (``Engine.clock``) that a test advances past a timeout instead of sleeping; its
worker half on another (``make_engine(worker_clock=...)``), as the two are processes apart.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.local import LOCAL_NODE, LocalBlockStore
from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.compat import connector_output, layer_kv_cache_tensor, transfer_results
from ucm_ray.vllm.connector import UcmRayConnector
from ucm_ray.vllm.metadata import LoadJob, UcmRayConnectorMetadata

MAX_LEN = 16384
PARTIAL = -1.0
"""What the stand-in forward writes into a block it filled only partly."""
TOKEN = 7
"""The token the stand-in model samples when every block its forward read held what computing
it writes."""
POISONED_TOKEN = 666
"""... and when one did not (``Engine.check_reads``): a token computed from wrong bytes."""

STORE_KEY = "harness_store"
"""The extra-config key that hands an engine's connector its store (any ``BlockStore``)."""
NODE_KEY = "harness_node"
"""... the node its worker stands on (``LOCAL_NODE`` for an in-process store)."""
CLOCK_KEY = "harness_clock"
"""... its scheduler half's clock (an ``AdvancingClock`` the test moves on) ..."""
WORKER_CLOCK_KEY = "harness_worker_clock"
"""... and its worker half's (the time of its step deadlines)."""


class HarnessConnector(UcmRayConnector):
    """The real connector, handed the store the harness chose (in its extra config) instead of
    joining Ray, and (on the worker) the test's doubles of its pool connections and index readers,
    if any (constructor arguments: the harness builds the worker half itself)."""

    subclass_extra_keys = (STORE_KEY, NODE_KEY, CLOCK_KEY, WORKER_CLOCK_KEY)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig, *,
                 pool_connections: type[PoolConnections] = PoolConnections,
                 index_readers: Callable[[str], IndexReaders] = IndexReaders) -> None:
        self._pool_connections = pool_connections
        self._index_readers = index_readers
        self._scheduler_role = role == KVConnectorRole.SCHEDULER  # ``clock`` is asked for during ``__init__``
        super().__init__(vllm_config, role, kv_cache_config)

    def _harness_setting(self, key: str) -> Any:
        return self._vllm_config.kv_transfer_config.kv_connector_extra_config[key]

    def pool_connections(self, config: UcmRayConfig, node_id: str) -> PoolConnections:
        return self._pool_connections(config.transport, node_id)

    def index_readers(self, config: UcmRayConfig, node_id: str) -> IndexReaders:
        return self._index_readers(node_id)

    def open_store(self, config: UcmRayConfig) -> BlockStore:
        store: BlockStore = self._harness_setting(STORE_KEY)
        return store

    def clock(self) -> AdvancingClock:
        clock: AdvancingClock = self._harness_setting(CLOCK_KEY if self._scheduler_role else WORKER_CLOCK_KEY)
        return clock

    def node_id(self, config: UcmRayConfig) -> str:
        """The node of the store's pools: the harness's one process stands for every role on it."""
        node: str = self._harness_setting(NODE_KEY)
        return node

    def fleet_pools(self, config: UcmRayConfig) -> Mapping[PoolKey, PoolDescriptor] | None:
        """An in-process store has no directory: its pools reach the worker with the first step."""
        return None if self._harness_setting(NODE_KEY) == LOCAL_NODE else super().fleet_pools(config)


def write_model_dir(path: str) -> str:
    """The smallest model config vLLM's ModelConfig accepts (no weights: nothing runs it)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": MAX_LEN,
                   "rms_norm_eps": 1e-6, "torch_dtype": "float32"}, f)
    return path


MAX_LAYERS = 64
"""Layers whose blocks hold distinct values: a load that put one layer's bytes in another is a
wrong block (values stay below 2**23, so ``numerics`` halves are exact in float32)."""


def block_value(block_hash: bytes, layer: int) -> float:
    """What computing a full block writes into ``layer`` (exact in float32)."""
    return float(int.from_bytes(bytes(block_hash)[:2], "little") * MAX_LAYERS + layer)


@dataclass
class Engine:
    """One engine: vLLM's scheduler with our connector, and our worker part on fake KV."""

    sched: Scheduler
    worker: UcmRayConnector
    kv: dict[str, torch.Tensor]
    layer_groups: list[tuple[str, int, bool]]  # (layer name, group, attention?) in forward order
    block_size: int
    hasher: object
    clock: AdvancingClock = field(default_factory=AdvancingClock)
    """The scheduler half's clock: ``clock.advance(s)`` stands for ``s`` seconds going by."""
    steps: int = 0
    deferred: dict[str, int] = field(default_factory=dict)  # steps a request waited on its lookup
    first: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (computed, scheduled)
    loaded_blocks: dict[str, int] = field(default_factory=dict)  # req -> blocks the plan loads
    prefill_computed: dict[str, int] = field(default_factory=dict)  # req -> prompt tokens computed
    resumed_at: dict[str, list[int]] = field(default_factory=dict)  # req -> computed tokens at each resume
    transfer_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """req -> the ``kv_transfer_params`` vLLM's output carried when the request finished (what a
    PD proxy hands the decode engine)."""
    wrong_blocks: int = 0
    """Loaded blocks whose bytes differed from what computing them writes, NOT reported as failed."""
    failed_loads: int = 0
    """Loaded blocks (or async loads) reported to vLLM as failed: it recomputes them."""
    graph_replay_below: int = 0
    """Steps scheduling fewer tokens than this run like a FULL CUDA graph replay: no layer hook
    (``wait_for_layer_load`` / ``save_kv_layer``) is called, as on a GPU."""
    numerics: float = 0.0
    """What this engine's forward adds to the values it computes for a loaded block's tail:
    another engine's bits for the same tokens may differ (GPU kernels vary with batch shape), so
    a load that lands after the forward wrote the tail would leave the other engine's values."""
    before_worker: Callable[[Engine, UcmRayConnectorMetadata], None] | None = None
    """A fault to play between the scheduler's plan (pins taken, slots granted) and the
    worker's copies."""
    check_reads: bool = False
    """Check, at each step's first attention layer, the full blocks before what the step computes
    (what its attention reads): the model samples ``POISONED_TOKEN`` for a request that read a
    block holding other bytes, so a test sees whether vLLM kept a token computed from a failed
    load (``wrong_blocks`` only sees loads that were not reported)."""
    async_scheduling: bool = False
    """Step as vLLM's engine core does under asynchronous scheduling (``AsyncScheduler``, a queue
    of two batches): a step is scheduled and run before the one before it is taken back."""
    _in_flight: list[tuple[Any, ModelRunnerOutput]] = field(default_factory=list)
    """Under ``async_scheduling``: (scheduler output, runner output) of steps run but not yet
    handed back, newest first."""
    _unhashed: list[tuple[str, str, int, int, int, int]] = field(default_factory=list)
    """(request, layer name, group, layer, block index, vLLM block id) of blocks a step filled
    before the scheduler knew their last token (asynchronous scheduling: it is sampled by the
    step before, whose output comes back after this step ran): written ``PARTIAL`` by the
    forward, given their value once the token is known (``_fill_unhashed``)."""

    @property
    def connector(self) -> UcmRayConnector:
        return self.sched.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        """``kv_transfer_params``: what a PD proxy sends with the request (vLLM reads them from
        the sampling params' ``extra_args``)."""
        extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        req = Request(request_id=req_id, prompt_token_ids=tokens, pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args),
                      block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        """One step of vLLM's engine core: schedule, run the worker (the stand-in forward), and
        hand the output back; under ``async_scheduling`` the output of the step before, once the
        next is scheduled and run (vLLM's batch queue of two)."""
        self.steps += 1
        if not self.async_scheduling:
            out = self.sched.schedule()
            self._apply(out, self._execute(out))
            return
        if self.sched.has_requests():
            out = self.sched.schedule()
            self._in_flight.insert(0, (out, self._execute(out)))
            if len(self._in_flight) < 2 and (out.total_num_scheduled_tokens or self.sched.has_requests()):
                return
        if self._in_flight:
            self._apply(*self._in_flight.pop())

    def _execute(self, out) -> ModelRunnerOutput:
        """What the model runner does with a scheduled step: the connector's worker hooks around
        the stand-in forward, and the step's sampled tokens and connector output."""
        meta = out.kv_connector_metadata
        assert isinstance(meta, UcmRayConnectorMetadata)
        self._count(out)
        loads = meta.loads.get(0, [])
        for job in loads:
            self.loaded_blocks[job.req_id] = self.loaded_blocks.get(job.req_id, 0) + len(job.blocks)
        if self.before_worker is not None:
            self.before_worker(self, meta)
        worker = self.worker
        worker.handle_preemptions(meta)  # as vLLM's model runner, before it touches new blocks
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        mismatched: dict[str, set[int]] = {}
        poisoned: set[str] = set()
        hooks = out.total_num_scheduled_tokens >= self.graph_replay_below
        # where each scheduled request's hit (and this step's computing) begins
        begins = {rid: self.sched.requests[rid].num_computed_tokens - n for rid, n in out.num_scheduled_tokens.items()}
        for index, (name, group, attention) in enumerate(self.layer_groups):
            if attention:
                self._write_tails(loads, begins, name, group, index)
            # as vLLM's layer wrapper: the layer hooks only while the connector has metadata bound
            layer_hooks = attention and hooks and worker.has_connector_metadata()
            if layer_hooks:
                worker.wait_for_layer_load(name)
            if attention and index == 0 and self.check_reads:
                poisoned = self._poisoned_reads(begins, name, group)
            self._check_loaded(loads, begins, name, group, index, mismatched)
            self._compute(out, name, group, index, attention)
            if layer_hooks:
                worker.save_kv_layer(name, self.kv[name], None)
        if out.total_num_scheduled_tokens:
            worker.wait_for_save()  # vLLM 0.26 calls none in a step without tokens: saves land anyway
        errors = worker.get_block_ids_with_load_errors()
        sending, recving, failed = transfer_results(worker, out.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        for req_id, blocks in mismatched.items():
            if req_id not in failed:
                self.wrong_blocks += len(blocks - errors)
        self.failed_loads += len(errors) + len(failed)
        return self._output(out, poisoned, connector_output(sending, recving, failed, errors, worker_meta))

    def _output(self, out, poisoned: set[str], kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        """The step's output as vLLM's model runner hands it back: a step without tokens only
        with what its workers reported (empty when they had nothing to say); otherwise each
        request's sampled token (``POISONED_TOKEN`` where its forward read other bytes)."""
        if not out.total_num_scheduled_tokens:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([POISONED_TOKEN if rid in poisoned else TOKEN] if done else [])
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_output)

    def _apply(self, out, runner_output: ModelRunnerOutput) -> None:
        outputs = self.sched.update_from_output(out, runner_output)
        self._fill_unhashed()
        self.transfer_params.update((output.request_id, output.kv_transfer_params)
                                    for engine_outputs in outputs.values() for output in engine_outputs.outputs
                                    if output.kv_transfer_params is not None)

    def run(self, *reqs: Request, timeout_s: float = 120.0) -> None:
        """Step until the requests finish. Bounded by time, not steps: while a lookup is in
        flight a step schedules nothing and returns at once, however slow a busy host is."""
        deadline = time.monotonic() + timeout_s
        while not all(r.is_finished() for r in reqs):
            assert time.monotonic() < deadline, "requests did not finish"
            self.step()

    def serve(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> tuple[int, int]:
        """Run one request to completion; returns (prompt tokens vLLM got without computing them
        when it first scheduled the request, prompt tokens it computed in all)."""
        self.run(self.add(req_id, tokens, max_tokens))
        return self.first[req_id][0], self.prefill_computed[req_id]

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step with nothing to run until every commit, release and removal was answered, so
        another engine sees this one's saves (vLLM's engine loop keeps stepping on its own)."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while not self.connector.scheduler_part.settled():
            assert time.monotonic() < deadline, "the store did not answer"
            time.sleep(0.001)
            if self.async_scheduling and not self.sched.has_requests() and not self._in_flight:
                # the batch queue schedules nothing without requests: a plan still collects answers
                self._apply(out := self.sched.schedule(), self._execute(out))
            else:
                self.step()

    def block_keys(self, tokens: list[int]) -> list[bytes]:
        """The store keys of the full blocks of ``tokens`` (rank 0, first attention group)."""
        from ucm_ray.keys import block_key

        probe = Request(request_id="probe", prompt_token_ids=tokens, pooling_params=None,
                        sampling_params=SamplingParams(max_tokens=1), block_hasher=self.hasher)
        namespace = self.connector.scheduler_part.namespaces[0]
        return [block_key(namespace, h, 0) for h in probe.block_hashes]

    def stats(self) -> dict[str, int]:
        """Both halves' counters since start-up."""
        return {**self.connector.scheduler_part.stats.totals, **self.worker.worker_part.stats.totals}

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()

    # --- the stand-in forward pass --------------------------------------------------------

    def _count(self, out) -> None:
        for r in self.sched.waiting:
            if r.request_id not in self.first:
                self.deferred[r.request_id] = self.deferred.get(r.request_id, 0) + 1
        for new in out.scheduled_new_reqs:
            if new.req_id in self.first:  # a preempted request handed back as new (the V2 model runner's way)
                self.resumed_at.setdefault(new.req_id, []).append(new.num_computed_tokens)
            self.first.setdefault(new.req_id, (new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_req_ids:
                self.resumed_at.setdefault(rid, []).append(computed)
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            before = req.num_computed_tokens - n  # the scheduler already advanced it
            if before < req.num_prompt_tokens:
                self.prefill_computed[rid] = self.prefill_computed.get(rid, 0) + min(n, req.num_prompt_tokens - before)

    def _fill_unhashed(self) -> None:
        """Blocks the forward filled whose hash is known now: what computing them wrote."""
        pending, self._unhashed = self._unhashed, []
        for rid, name, group, layer, i, block_id in pending:
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished():
                continue
            table = self.sched.kv_cache_manager.get_block_ids(rid)[group]
            if i >= len(table) or table[i] != block_id:
                continue  # preempted meanwhile: the block is no longer the request's
            if i < len(req.block_hashes):
                self.kv[name][block_id].fill_(block_value(req.block_hashes[i], layer))
            else:
                self._unhashed.append((rid, name, group, layer, i, block_id))

    def _poisoned_reads(self, begins: dict[str, int], name: str, group: int) -> set[str]:
        """The scheduled requests whose attention reads, in layer ``name``, a full block before
        what the step computes that does not hold what computing it writes."""
        poisoned = set()
        layer = [n for n, _, _ in self.layer_groups].index(name)
        for rid, begin in begins.items():
            req = self.sched.requests[rid]
            table = self.sched.kv_cache_manager.get_block_ids(rid)[group]
            for i in range(min(begin // self.block_size, len(req.block_hashes))):
                expected = block_value(req.block_hashes[i], layer)
                block = self.kv[name][table[i]]
                if not bool(((block == expected) | (block == expected + self.numerics)).all()):
                    poisoned.add(rid)
                    break
        return poisoned

    def _compute(self, out, name: str, group: int, layer: int, attention: bool) -> None:
        """Write what a forward pass over this step's tokens would leave in ``name``."""
        bs, tensor = self.block_size, self.kv[name]
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens
            start = end - n
            table = self.sched.kv_cache_manager.get_block_ids(rid)[group]
            hashes = req.block_hashes
            if attention:
                for i in range(start // bs, -(-end // bs)):
                    full = (i + 1) * bs <= end and i < len(hashes)
                    tensor[table[i]].fill_(block_value(hashes[i], layer) if full else PARTIAL)
                    if (i + 1) * bs <= end and i >= len(hashes) and self.async_scheduling:
                        self._unhashed.append((rid, name, group, layer, i, table[i]))
            else:  # the running state of [0, end) lives in block ceil(end / bs) - 1
                i = -(-end // bs) - 1
                if table[i] != 0:
                    exact = end % bs == 0 and i < len(hashes)
                    tensor[table[i]].fill_(block_value(hashes[i], layer) if exact else PARTIAL)

    def _tail(self, job: LoadJob, begins: dict[str, int], group: int) -> tuple[int, int] | None:
        """(vLLM block id, first position this step computes) of the loaded block the hit ends
        inside, if the step computes its tail."""
        begin = begins.get(job.req_id)
        if begin is None or begin % self.block_size == 0:
            return None
        table = self.sched.kv_cache_manager.get_block_ids(job.req_id)[group]
        block_id = table[begin // self.block_size]
        loaded = job.blocks.block_ids[job.blocks.groups == group].tolist()
        return (block_id, begin % self.block_size) if block_id in loaded else None

    def _write_tails(self, loads: list[LoadJob], begins: dict[str, int], name: str, group: int, layer: int) -> None:
        """vLLM's kv-cache update, which runs before the layer's hook: the tokens this step
        recomputes in a loaded block's tail, with this engine's values (``numerics``)."""
        for job in loads:
            tail = self._tail(job, begins, group)
            if tail is not None:
                req = self.sched.requests[job.req_id]
                block_id, position = tail
                value = block_value(req.block_hashes[begins[job.req_id] // self.block_size], layer) + self.numerics
                self.kv[name][block_id][:, position:].fill_(value)

    def _check_loaded(self, loads: list[LoadJob], begins: dict[str, int], name: str, group: int, layer: int,
                      mismatched: dict[str, set[int]]) -> None:
        for job in loads:
            req = self.sched.requests.get(job.req_id)
            if req is None:
                continue
            table = self.sched.kv_cache_manager.get_block_ids(job.req_id)[group]
            tail = self._tail(job, begins, group)
            for block_id in job.blocks.block_ids[job.blocks.groups == group].tolist():
                expected = block_value(req.block_hashes[table.index(block_id)], layer)
                block = self.kv[name][block_id]
                position = tail[1] if tail is not None and tail[0] == block_id else self.block_size
                if not (bool(torch.all(block[:, :position] == expected))
                        and bool(torch.all(block[:, position:] == expected + self.numerics))):
                    mismatched.setdefault(job.req_id, set()).add(block_id)


def make_engine(store: BlockStore, model_dir: str, *, block_size: int = 128, num_spec: int = 0,
                hybrid: bool = False, max_batched: int = 8192, num_blocks: int = 96,
                layerwise: bool = True, hash_algo: str = "sha256", config: UcmRayConfig | None = None,
                extra: dict | None = None, failure_policy: str = "recompute",
                sliding_window: int | None = None, state_block_size: int | None = None,
                num_layers: int = 2, kv_heads: int = 1, head_size: int = 16, max_seqs: int = 8,
                pool_connections: type[PoolConnections] = PoolConnections,
                index_readers: Callable[[str], IndexReaders] = IndexReaders,
                async_scheduling: bool = False, told_async: bool | None = None,
                clock: AdvancingClock | None = None, worker_clock: AdvancingClock | None = None) -> Engine:
    """An engine whose connector uses ``store`` (give each engine its own client of it).
    ``pool_connections``, ``index_readers``: what its worker reaches the pools and reads their
    indexes with (a test's double: a pool that fails, an index on another node).
    ``max_seqs``: requests running at once (vLLM's ``max_num_seqs``).
    ``state_block_size``: the hybrid's state blocks, when not the attention block size.
    ``num_layers``, ``kv_heads``, ``head_size``: the attention layers' KV (one layer's block is
    ``block_size * kv_heads * head_size * 2 * 4`` bytes; a benchmark sizes it as a model's).
    ``async_scheduling``: vLLM's ``AsyncScheduler`` and its engine core's batch queue;
    ``told_async``: what the engine's config says (default: the same), which the connector reads:
    a test may run asynchronous scheduling behind a config that says otherwise, to show what
    synchronous loads would do under it. ``clock``: the scheduler half's (default: one of its
    own; a test that shares one with the store's shards, ``LocalBlockStore(clock=...)``, moves
    both at once); ``worker_clock``: the worker's (default: one following the host's time); a
    frozen one passes a step's deadline only when the test's doubles say the
    time went by (``tests/support/faulty_pools.hung_loads``)."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ValueError(f"num_layers {num_layers}: the harness tells apart 1 to {MAX_LAYERS} layers")
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32", seed=0)
    spec = None
    if num_spec:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model,
                                 target_parallel_config=ParallelConfig())
    node = LOCAL_NODE if isinstance(store, LocalBlockStore) else ray.get_runtime_context().get_node_id()
    clock = AdvancingClock() if clock is None else clock
    extra = {**(config or UcmRayConfig()).to_dict(), "layerwise": layerwise, **(extra or {}),
             STORE_KEY: store, NODE_KEY: node, CLOCK_KEY: clock,
             WORKER_CLOCK_KEY: AdvancingClock() if worker_clock is None else worker_clock}
    vcfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                 mamba_cache_mode="align" if hybrid else "none",
                                 prefix_caching_hash_algo=hash_algo),
        scheduler_config=SchedulerConfig(max_model_len=MAX_LEN, is_encoder_decoder=False,
                                         max_num_batched_tokens=max_batched, max_num_seqs=max_seqs,
                                         enable_chunked_prefill=True, async_scheduling=False),
        device_config=DeviceConfig("cpu"), speculative_config=spec,
        kv_transfer_config=KVTransferConfig(kv_connector="HarnessConnector",
                                            kv_connector_module_path="ucm_ray.testing.harness",
                                            kv_role="kv_both", kv_load_failure_policy=failure_policy,
                                            kv_connector_extra_config=extra))
    vcfg.cache_config.num_gpu_blocks = num_blocks
    # vLLM turns asynchronous scheduling off on CPU when the config is built
    vcfg.scheduler_config.async_scheduling = async_scheduling if told_async is None else told_async
    # Small heads keep the fake KV cheap; the scheduler never checks them against the model.
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    groups = [KVCacheGroupSpec(layers, attn)]
    if sliding_window is not None:  # layer 1 in a sliding-window group, as Gemma-3 has
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size,
                                   dtype=torch.float32, sliding_window=sliding_window)
        groups = [KVCacheGroupSpec(layers[:1], attn), KVCacheGroupSpec(layers[1:], window)]
    if hybrid:
        # One state per layer, as LFM2's short convolutions have; its page is padded to the
        # attention page size, and the layer's tensor is a view of the state part of each page.
        mamba = MambaSpec(block_size=state_block_size or block_size, shapes=((3, 512),), dtypes=(torch.float32,),
                          mamba_cache_mode="align", page_size_padded=attn.page_size_bytes)
        groups.append(KVCacheGroupSpec([f"model.layers.{num_layers}.mixer"], mamba))
    page = attn.page_size_bytes
    tensors = [layer_kv_cache_tensor(n, page, num_blocks) for g in groups for n in g.layer_names]
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    kcfg.hash_block_size = block_size
    kcfg.cache_hit_alignment_tokens = block_size
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    sched = scheduler_cls(vllm_config=vcfg, kv_cache_config=kcfg,
                          structured_output_manager=StructuredOutputManager(vcfg),
                          block_size=math.lcm(*(g.kv_cache_spec.block_size for g in groups)),
                          hash_block_size=block_size, log_stats=True)
    worker = HarnessConnector(vcfg, KVConnectorRole.WORKER, kcfg, pool_connections=pool_connections,
                              index_readers=index_readers)
    kv = {n: torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size, dtype=torch.float32) for n in layers}
    layer_groups = [(n, 0, True) for n in layers]
    if hybrid:
        pages = torch.zeros(num_blocks, page // 4, dtype=torch.float32)
        kv[f"model.layers.{num_layers}.mixer"] = pages[:, :3 * 512].view(num_blocks, 3, 512)
        layer_groups.append((f"model.layers.{num_layers}.mixer", 1, False))
    worker.register_kv_caches(kv)
    init_none_hash(sha256)
    return Engine(sched, worker, kv, layer_groups, block_size, get_request_block_hasher(block_size, sha256), clock,
                  async_scheduling=async_scheduling)


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()
