"""The scheduler half of the connector: lookups, the hit policy, and the step plan.

It never blocks the scheduler on the network: a lookup is posted once per
request (one Ray call per shard per tp rank) and ``get_num_new_matched_tokens``
answers ``None`` ("ask again") until it lands. Lookups *pin* what they find,
so nothing vLLM was promised can be evicted before the worker copies it; the
worker releases the pins when its copies are done.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.keys import Namespace, block_key, state_key
from ucm_ray.store.client import AcquireFuture, ReadLease, StoreClient
from ucm_ray.vllm.metadata import BlockLoad, BlockSave, RequestLoad, UcmRayConnectorMetadata
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""vLLM's placeholder block (never holds data): loading into it would corrupt shared state."""

LOOKUP_GRACE_S = 0.002
"""How long a lookup may take before the scheduler is told to ask again: most land within
one actor round trip, and answering on the first call saves the request a scheduler step."""


def engine_namespaces(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", label: str) -> list[bytes]:
    """One namespace digest per tensor-parallel rank: everything that shapes a block's bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    specs = ";".join(f"{type(g.kv_cache_spec).__name__}:{g.kv_cache_spec!r}:{len(g.layer_names)}"
                     for g in kv_cache_config.kv_cache_groups)
    extra = "|".join([
        f"pp={pc.pipeline_parallel_size}",
        f"dcp={getattr(pc, 'decode_context_parallel_size', 1)}",
        f"device={vllm_config.device_config.device_type}",
        f"attn={getattr(vllm_config, 'attention_config', None)!r}",
        f"spec={specs}",
    ])
    return [Namespace(label=label, model=f"{mc.model}@{mc.revision}", dtype=str(mc.dtype),
                      cache_dtype=str(cc.cache_dtype), block_size=cc.block_size,
                      layout=vllm_config.device_config.device_type, tp_size=pc.tensor_parallel_size,
                      tp_rank=rank, extra=extra).digest()
            for rank in range(pc.tensor_parallel_size)]


@dataclass
class _Lookup:
    """One request's lookup: per tp rank, the keys asked for and the pins that came back."""

    futures: list[AcquireFuture]
    attn_keys: list[list[list[bytes]]]  # [rank][attention group][block]
    state_keys: list[list[list[bytes]]]  # [rank][state group][lcm boundary - 1]
    leases: list[ReadLease] | None = None
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Tracked:
    request: "Request"
    lookup: _Lookup | None = None
    hit_tokens: int = 0  # LCM/block-aligned prefix found in the store
    local_tokens: int = 0  # vLLM's block-aligned local hit at lookup time
    load: list[RequestLoad] | None = None  # per rank, set after allocation, consumed by the next plan
    saved_blocks: dict[int, int] = field(default_factory=dict)  # group -> blocks already planned
    last_state_pos: int = 0


class SchedulerPart:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: UcmRayConfig,
                 client: StoreClient) -> None:
        self._config = config
        self._client = client
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        if algo.startswith("xxhash") and os.getenv("PYTHONHASHSEED") is None:
            raise ValueError(f"ucm-ray: prefix_caching_hash_algo={algo!r} seeds block hashes randomly per "
                             "process, so no engine could reuse another's blocks; use 'sha256' / "
                             "'sha256_cbor', or set PYTHONHASHSEED to one value on every engine")
        self._groups = kv_cache_config.kv_cache_groups
        self._attn = [i for i, g in enumerate(self._groups) if isinstance(g.kv_cache_spec, AttentionSpec)]
        self._states = [i for i, g in enumerate(self._groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        other = set(range(len(self._groups))) - set(self._attn) - set(self._states)
        if other:
            raise ValueError(f"ucm-ray: unsupported kv-cache group spec(s) "
                             f"{[type(self._groups[i].kv_cache_spec).__name__ for i in other]}")
        self._bs = [g.kv_cache_spec.block_size for g in self._groups]
        self._lcm = math.lcm(*self._bs) if self._bs else 1
        self._hash_bs = (getattr(kv_cache_config, "hash_block_size", None)
                         or resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
        spec = vllm_config.speculative_config
        k = spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 0
        self.recompute = policy.recompute_tokens(config.layerwise, k)
        self._ns = engine_namespaces(vllm_config, kv_cache_config, config.namespace)
        self._tracked: dict[str, _Tracked] = {}
        self._kv_manager: KVCacheManager | None = None
        self._step = 0
        self.stats = UcmRayStats()
        log.info("ucm-ray scheduler: groups attn=%s state=%s block sizes=%s lcm=%d hash=%d recompute=%d",
                 self._attn, self._states, self._bs, self._lcm, self._hash_bs, self.recompute)

    @property
    def hybrid(self) -> bool:
        return bool(self._states)

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_manager = manager

    # --- lookups -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._tracked.get(request.request_id)
        if t is None or t.request is not request:
            t = self._tracked[request.request_id] = _Tracked(request)
        if t.lookup is not None and time.monotonic() - t.lookup.started > self._config.lease_s / 2:
            self._release(t)  # waited so long in the queue that its pins may lapse: look again
        if t.lookup is None:
            t.lookup = self._post_lookup(request)
            if t.lookup is None:
                return 0, False
            deadline = time.monotonic() + LOOKUP_GRACE_S
            while not all(f.poll() for f in t.lookup.futures):
                if time.monotonic() > deadline:
                    self.stats.add(lookups_deferred=1)
                    return None, False
        elif not all(f.poll() for f in t.lookup.futures):
            return None, False
        if t.lookup.leases is None:
            t.lookup.leases = [f.result() for f in t.lookup.futures]
            t.hit_tokens = self._hit_tokens(t.lookup)
        t.local_tokens = num_computed_tokens
        if t.hit_tokens <= num_computed_tokens:
            ext = 0
        elif self.hybrid:
            ext = t.hit_tokens - num_computed_tokens  # truncated before the lookup: nothing to trim
        else:
            ext = policy.dense_external_hit(request.num_tokens, num_computed_tokens, t.hit_tokens,
                                            self.recompute)
        self.stats.add(lookups=1, query_tokens=request.num_tokens, hit_tokens=ext,
                       local_hit_tokens=num_computed_tokens,
                       miss_tokens=request.num_tokens - num_computed_tokens - ext,
                       recompute_trimmed_tokens=max(0, t.hit_tokens - num_computed_tokens - ext))
        # Hybrid loads are asynchronous: vLLM can only take back a failed load of a
        # multi-group (hybrid) cache through ``failed_recving``, which exists for async loads.
        return ext, self.hybrid and ext > 0

    def _post_lookup(self, request: "Request") -> _Lookup | None:
        hashes = request.block_hashes
        if self.hybrid:
            max_lcm = policy.hybrid_max_hit_blocks(request.num_tokens, self.recompute, self._lcm)
            max_tokens = max_lcm * self._lcm
        else:
            max_tokens = len(hashes) * self._hash_bs
        max_tokens = min(max_tokens, len(hashes) * self._hash_bs)
        if max_tokens <= 0:
            return None
        attn_keys, state_keys, futures = [], [], []
        for ns in self._ns:
            per_group = [[block_key(ns, self._hash_at(hashes, (i + 1) * self._bs[g]), g)
                          for i in range(max_tokens // self._bs[g])] for g in self._attn]
            per_state = [[state_key(ns, self._hash_at(hashes, b * self._lcm), g, b * self._lcm)
                          for b in range(1, max_tokens // self._lcm + 1)] for g in self._states]
            attn_keys.append(per_group)
            state_keys.append(per_state)
            flat = [k for keys in per_group + per_state for k in keys]
            futures.append(self._client.acquire_async(flat))
        return _Lookup(futures, attn_keys, state_keys)

    def _hash_at(self, hashes: list, end_token: int) -> bytes:
        """The chained hash identifying the prefix ``[0, end_token)``."""
        return hashes[end_token // self._hash_bs - 1]

    def _hit_tokens(self, lk: _Lookup) -> int:
        """Stage 1 (longest attention prefix over all ranks and groups), then for hybrid
        models stage 2 (furthest LCM boundary whose state every rank and state group has)."""
        assert lk.leases is not None
        prefix: int | None = None
        boundaries = len(lk.state_keys[0][0]) if self.hybrid and lk.state_keys[0] else 0
        states = [True] * boundaries
        for rank, lease in enumerate(lk.leases):
            found = iter(loc is not None for loc in lease.locations)  # attention keys, then states
            for g, keys in zip(self._attn, lk.attn_keys[rank]):
                present = [next(found) for _ in keys]
                tokens = (present.index(False) if False in present else len(present)) * self._bs[g]
                prefix = tokens if prefix is None else min(prefix, tokens)
            for keys in lk.state_keys[rank]:
                states = [next(found) and ok for ok in states[:len(keys)]]
        if not self.hybrid:
            return prefix or 0
        return policy.hybrid_hit_blocks((prefix or 0) // self._lcm, states) * self._lcm

    # --- allocation and the step plan ----------------------------------------------------

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        t = self._tracked.get(request.request_id)
        if t is None or t.lookup is None or t.lookup.leases is None:
            return  # no lookup, or the second call of an async load (already planned)
        if num_external_tokens <= 0:
            self._release(t)
            return
        block_ids = blocks.get_block_ids()
        start = t.local_tokens
        end = start + num_external_tokens
        loads = []
        for rank, lease in enumerate(t.lookup.leases):
            out: list[BlockLoad] = []
            locs = iter(lease.locations)
            for g, keys in zip(self._attn, t.lookup.attn_keys[rank]):
                group_locs = [next(locs) for _ in keys]
                first, last = start // self._bs[g], -(-end // self._bs[g])  # the tail block is loaded whole
                out.extend(BlockLoad(g, block_ids[g][i], group_locs[i]) for i in range(first, last))
            usable = True
            if self.hybrid:
                b = t.hit_tokens // self._lcm  # the state at the hit's end boundary
                for g, keys in zip(self._states, t.lookup.state_keys[rank]):
                    group_locs = [next(locs) for _ in keys]
                    # vLLM keeps the running state of a request that computed N tokens in the
                    # group's block N // block_size - 1; a null block there means no room for it.
                    target = block_ids[g][t.hit_tokens // self._bs[g] - 1]
                    usable = usable and target != NULL_BLOCK_ID
                    out.append(BlockLoad(g, target, group_locs[b - 1]))
            if not usable:
                log.error("ucm-ray: no state block allocated for %s at %d tokens; the load is failed so "
                          "vLLM recomputes", request.request_id, t.hit_tokens)
            loads.append(RequestLoad(request.request_id, out if usable else [], lease.leases,
                                     complete_in_start=self.hybrid, is_async=self.hybrid, failed=not usable))
        t.load = loads
        t.lookup = None  # the pins now belong to the worker
        for g in self._attn:  # blocks that came from the store need no save
            t.saved_blocks[g] = max(t.saved_blocks.get(g, 0), -(-end // self._bs[g]))
        t.last_state_pos = max(t.last_state_pos, t.hit_tokens if self.hybrid else 0)
        self.stats.add(load_blocks=len(loads[0].blocks))

    def build_connector_meta(self, out: "SchedulerOutput") -> UcmRayConnectorMetadata:
        self._step += 1
        meta = UcmRayConnectorMetadata(step=self._step,
                                       loads={r: [] for r in range(len(self._ns))},
                                       saves={r: [] for r in range(len(self._ns))})
        for req_id, t in self._tracked.items():
            if t.load is None:
                continue
            n_sched = out.num_scheduled_tokens.get(req_id, 0)
            for rank, ld in enumerate(t.load):
                ld.complete_in_start = ld.complete_in_start or n_sched < self.recompute
                meta.loads[rank].append(ld)
            t.load = None
        for req_id, n_sched in out.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is not None:
                self._plan_saves(t, n_sched, meta)
        return meta

    def _plan_saves(self, t: _Tracked, n_sched: int, meta: UcmRayConnectorMetadata) -> None:
        """Blocks that are full (and hashed) once this step ran, and the state at the chunk end."""
        req = t.request
        start = req.num_computed_tokens  # before this step: vLLM advances it after planning
        end = start + n_sched
        hashes = req.block_hashes
        if self._kv_manager is None:
            return
        block_ids = None
        for g in self._attn:
            full = min(end, len(hashes) * self._hash_bs) // self._bs[g]
            first = t.saved_blocks.get(g, 0)
            if full <= first:
                continue
            block_ids = block_ids or self._kv_manager.get_block_ids(req.request_id)
            for rank, ns in enumerate(self._ns):
                meta.saves[rank].extend(BlockSave(g, block_ids[g][i],
                                                  block_key(ns, self._hash_at(hashes, (i + 1) * self._bs[g]), g))
                                        for i in range(first, full))
            t.saved_blocks[g] = full
        for pos in policy.state_dump_positions(start, end, self._lcm) if self.hybrid else ():
            if pos > len(hashes) * self._hash_bs or pos <= t.last_state_pos:
                continue
            block_ids = block_ids or self._kv_manager.get_block_ids(req.request_id)
            for rank, ns in enumerate(self._ns):
                meta.saves[rank].extend(BlockSave(g, block_ids[g][pos // self._bs[g] - 1],
                                                  state_key(ns, self._hash_at(hashes, pos), g, pos))
                                        for g in self._states)
            t.last_state_pos = pos

    # --- endings -------------------------------------------------------------------------

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        t = self._tracked.pop(request.request_id, None)
        if t is not None:
            self._release(t)
        return False, None

    def _release(self, t: _Tracked) -> None:
        """Unpin a lookup whose pins no worker will release (no load, or never scheduled)."""
        if t.lookup is not None and t.lookup.leases is not None:
            for lease in t.lookup.leases:
                self._client.release_async(lease)
        t.lookup = None
        t.load = None

    def take_stats(self) -> UcmRayStats | None:
        return self.stats.take()
